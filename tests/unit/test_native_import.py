import hybridmoe._native as native


def test_cpu_features_reports_every_isa_flag():
    feats = native.cpu_features()
    assert set(feats) >= {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"}
    assert all(isinstance(v, bool) for v in feats.values())
    # AMX implies AVX-512 on every CPU that has it; a report saying otherwise is a cpuid bug.
    if feats["amx_bf16"]:
        assert feats["avx512f"]
