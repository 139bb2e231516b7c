import csv, gzip, re, sys, collections
src = open('/work/main/lab/megakernel_v2/stream_step.cu').read().split('\n')
# function ranges: a line starting a __device__/__global__ function definition
funcs = []
for i, line in enumerate(src, 1):
    m = re.match(r'(?:template <[^>]*>\s*)?__(?:device|global)__[^(]*?\b(\w+)\s*\(', line)
    if m and not line.rstrip().endswith(';'):
        funcs.append((i, m.group(1)))
def func_of(line):
    name = '?'
    for start, n in funcs:
        if start <= line: name = n
        else: break
    return name
# sass: offset -> chain of lines (innermost first)
chain = {}; text = {}
cur = []; pending_reset = True
for line in open(sys.argv[2]):
    m = re.match(r'\s*//## File ".*", line (\d+)(?: inlined at ".*", line (\d+))?', line)
    if m:
        if pending_reset: cur = []; pending_reset = False
        cur.append(int(m.group(1)))
        continue
    m = re.match(r'\s*/\*([0-9a-f]{4,})\*/\s+(.*?);', line)
    if m:
        off = int(m.group(1), 16)
        chain[off] = list(cur); text[off] = m.group(2).strip()
        pending_reset = True
rows = list(csv.reader(gzip.open(sys.argv[1], 'rt')))
hdr = rows[1]; data = rows[2:]
ix = {h: i for i, h in enumerate(hdr)}
base = int(data[0][0], 16)
reasons = [h for h in hdr if h.startswith('stall_') and 'Not Issued' not in h]
by_func = collections.Counter(); by_line = collections.Counter(); by_reason = collections.defaultdict(collections.Counter)
total = 0; mism = 0
for r in data:
    off = int(r[0], 16) - base
    smp = int(r[ix['Warp Stall Sampling (All Samples)']] or 0)
    if off in text and text[off].split()[0] not in r[1]: mism += 1
    ch = chain.get(off, [])
    inner = ch[0] if ch else 0
    # caller function within the kernel: the first line in the chain that is not in a helper
    fnames = [func_of(l) for l in ch]
    key = ' < '.join(dict.fromkeys(fnames)) if fnames else '?'
    by_func[key] += smp; by_line[(inner, func_of(inner))] += smp; total += smp
    for rs in reasons:
        v = int(r[ix[rs]] or 0)
        if v: by_reason[key][rs] += v
print('total samples', total, 'sass mismatches', mism, 'of', len(data))
for k, v in by_func.most_common(25):
    top = ', '.join(f'{rs[6:]} {100*c/v:.0f}%' for rs, c in by_reason[k].most_common(3)) if v else ''
    print(f'{100*v/total:5.1f}%  {k[:110]}  [{top}]')
print('--- lines')
for (l, f), v in by_line.most_common(30):
    print(f'{100*v/total:5.1f}%  {l:5d} {f:18s} {src[l-1].strip()[:100] if l else ""}')
