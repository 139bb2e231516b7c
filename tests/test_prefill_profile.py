"""bench/prefill_profile.py: the classifier on real kernel and op names, the gaps on synthetic intervals, the CUDA
path's correlation on fake events, and `bench engine --profile-prefill` end to end on the CPU."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from northcode.bench.prefill_profile import CATEGORIES, Item, classify, device_items, split, union_us
from northcode.cli import main

GROUPED = ("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::"
           "GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >, cutlass::gemm::collective::"
           "CollectiveMma<cutlass::gemm::MainloopSm90ArrayTmaGmmaWarpSpecializedCooperative<4, cute::tuple<cute::C<1>"
           ", cute::C<1>, cute::C<1> > > > > > >(at::cuda::detail::enable_3x_kernel_for_sm9x::Params)")
SDPA = ("aten::_efficient_attention_forward", "aten::_scaled_dot_product_efficient_attention",
        "aten::scaled_dot_product_attention")
LINEAR = ("aten::mm", "aten::matmul", "aten::linear")

# (name, the CPU ops it ran under, innermost first) -> category; CUDA names as the H200's profiles print them
CASES = [
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
     "cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)", SDPA, "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
     "cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true, false, false, "
     "true, true, false, false>(pytorch_flash::Flash_fwd_params)", (), "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", (), "attention"),
    ("triton_tem_fused_flex_attention_0", (), "attention"),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_"
     "cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(float)#1}> >(int, T3)",
     ("aten::copy_", "aten::where", *SDPA), "attention"),  # the mask's cast inside SDPA
    ("aten::_scaled_dot_product_flash_attention_for_cpu", ("aten::scaled_dot_product_attention",), "attention"),
    ("aten::bmm", ("aten::matmul", "aten::_scaled_dot_product_attention_math", "aten::scaled_dot_product_attention"),
     "attention"),
    (GROUPED, ("aten::_grouped_mm",), "expert GEMMs"),
    (GROUPED, (), "expert GEMMs"),  # uncorrelated: the name alone
    ("void at::cuda::detail::prepare_grouped_gemm_data<cutlass::bfloat16_t, cutlass::bfloat16_t, float>(...)",
     ("aten::_grouped_mm",), "expert GEMMs"),
    ("aten::mm", ("aten::_grouped_mm",), "expert GEMMs"),  # the CPU's grouped GEMM, one mm a group
    ("aten::_grouped_mm", (), "expert GEMMs"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", LINEAR, "other GEMMs"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x"
     "_cublas", LINEAR, "other GEMMs"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn", ("aten::addmm",), "other GEMMs"),
    ("void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false, false>(...)",
     LINEAR, "other GEMMs"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16>(...)", LINEAR,
     "other GEMMs"),
    ("aten::mm", LINEAR[1:], "other GEMMs"),
    ("aten::baddbmm", (), "other GEMMs"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
     "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)",
     ("aten::add_",), "copies and elementwise"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>, "
     "unsigned int, 4, 64, 64>(...)", ("aten::cat",), "copies and elementwise"),
    ("void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<...> >(long, ...)",
     ("aten::index",), "copies and elementwise"),
    ("void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*, int, long, long, long, long, bool)",
     ("aten::index_select",), "copies and elementwise"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
     "at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, "
     "unsigned int, float, 4, 4> >(...)", ("aten::sum",), "copies and elementwise"),
    ("Memcpy DtoD (Device -> Device)", ("aten::copy_",), "copies and elementwise"),
    ("Memset (Device)", (), "copies and elementwise"),
    ("triton_poi_fused_add_mul_0", (), "copies and elementwise"),
    ("aten::index_copy_", (), "copies and elementwise"),
    ("aten::_fused_rms_norm", ("aten::rms_norm",), "copies and elementwise"),
    ("aten::lt", (), "copies and elementwise"),
    ("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<at_cuda_detail::cub::DeviceRadixSortPolicy<long, "
     "long, unsigned long long>::Policy800, false, long, long, unsigned long long, int, int>(...)", ("aten::sort",),
     "other"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(...)", ("aten::topk",), "other"),
    ("void at::native::(anonymous namespace)::searchsorted_cuda_kernel<long, long>(...)", ("aten::searchsorted",),
     "other"),
    ("aten::as_strided", ("aten::select",), "other"),
    ("aten::_local_scalar_dense", ("aten::item",), "other"),
    ("aten::empty", (), "other"),
]


@pytest.mark.parametrize(("name", "parents", "category"), CASES, ids=[f"{c[2]}:{c[0][:40]}" for c in CASES])
def test_classify_real_kernel_and_op_names(name, parents, category):
    assert classify(name, parents) == category


def test_union_counts_overlapping_intervals_once():
    assert union_us([]) == 0
    assert union_us([(0, 10), (5, 15), (20, 30), (21, 22), (30, 31)]) == 26
    assert union_us([(5, 6), (0, 10)]) == 10


def test_split_gaps_are_the_window_minus_the_busy_union():
    items = [Item("nvjet_tst_64x8", LINEAR, 30, (10, 40)),  # 10..40
             Item(GROUPED, ("aten::_grouped_mm",), 20, (40, 60)),
             Item("fmha_cutlassF", SDPA, 15, (70, 85)),
             Item("Memcpy DtoD (Device -> Device)", (), 5, (80, 85))]  # a second stream, inside the fmha
    result = split(items, (0.0, 100.0), "CUDA kernels", 16)
    ms = result.categories_ms
    assert list(ms) == list(CATEGORIES)
    assert ms["gaps"] == pytest.approx(0.035)  # 100 - (10..60 + 70..85) us
    assert (ms["other GEMMs"], ms["expert GEMMs"], ms["attention"]) == pytest.approx((0.03, 0.02, 0.015))
    assert ms["copies and elementwise"] == pytest.approx(0.005) and ms["other"] == 0
    assert result.wall_ms == pytest.approx(0.1)
    assert result.top[0] == {"name": "nvjet_tst_64x8", "category": "other GEMMs", "ms": pytest.approx(0.03), "count": 1}


def _event(event_id, name, device, start, end, linked=0, parent=None, annotation=False):
    return SimpleNamespace(id=event_id, name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                           linked_correlation_id=linked, cpu_parent=parent, is_user_annotation=annotation,
                           is_async=False)


def test_device_items_take_the_launching_op_and_its_parents_and_clip_to_the_window():
    grouped = _event(7, "aten::_grouped_mm", DeviceType.CPU, 0, 5)
    mm = _event(8, "aten::mm", DeviceType.CPU, 6, 7, parent=_event(9, "aten::linear", DeviceType.CPU, 6, 8))
    runtime = _event(8, "cudaLaunchKernel", DeviceType.CPU, 1, 2, linked=7)  # CUPTI's id 8: not the mm
    events = [grouped, mm, runtime,
              _event(100, GROUPED, DeviceType.CUDA, 10, 30, linked=7),
              _event(101, "nvjet_tst_128x256", DeviceType.CUDA, 95, 120, linked=8),  # runs past the window
              _event(102, "northcode.bench.prefill", DeviceType.CUDA, 0, 100, annotation=True),
              _event(103, "Memset (Device)", DeviceType.CUDA, 200, 210)]  # outside
    items = device_items(events, (0.0, 100.0))
    assert [(i.name, i.parents, i.busy_us, i.interval) for i in items] == [
        (GROUPED, ("aten::_grouped_mm",), 20, (10, 30)),
        ("nvjet_tst_128x256", ("aten::mm", "aten::linear"), 5, (95, 100))]
    assert [classify(i.name, i.parents) for i in items] == ["expert GEMMs", "other GEMMs"]


def test_bench_engine_profile_prefill_splits_the_tiny_cpu_prefill(capsys):
    args = ["bench", "engine", "--preset", "tiny", "--device", "cpu", "--prompt-len", "256", "--batch-sizes", "1",
            "--turn-len", "4", "--context", "12", "--decode-tokens", "3", "--num-pages", "1024", "--profile-prefill"]
    assert main([*args, "--json"]) == 0
    profile = json.loads(capsys.readouterr().out)["prefill_profile"]
    assert profile["source"] == "CPU ops" and profile["prompt_len"] == 256
    ms = profile["categories_ms"]
    assert list(ms) == list(CATEGORIES)
    assert sum(ms.values()) == pytest.approx(profile["wall_ms"], rel=0.03)  # one thread's ops: no overlap
    assert ms["gaps"] < profile["wall_ms"] / 2  # the engine thread's ops were recorded
    for category in ("attention", "expert GEMMs", "other GEMMs", "copies and elementwise"):
        assert ms[category] > 0, category
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("  prefill profile (256 tokens"))
    assert [line.split()[0] for line in lines[start + 2:start + 2 + len(CATEGORIES)]] == [
        "attention", "expert", "other", "copies", "other", "gaps"]
