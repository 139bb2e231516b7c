"""Benchmarks (`northcode bench decode`, `northcode bench engine`), the paged caches they build (decode_setup), and
the whole-step checks the GPU tests assert (decode_check, over decode_oracle). Experiment rigs live in lab/."""
