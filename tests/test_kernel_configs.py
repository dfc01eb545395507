"""Launch configs per GPU: a named GPU's own table, else its compute capability's, else the default."""

from nf4convert.kernels import configs


def test_tables_by_gpu_name_then_capability(monkeypatch):
    own = ((None, configs.Config(4096, 8, False)),)
    monkeypatch.setitem(configs.GPU_CONFIGS, "H999", own)
    assert configs.table_for((9, 0), "NVIDIA H999 141GB") is own  # same capability as the H100, own table
    assert configs.table_for((9, 0), "NVIDIA H100 80GB HBM3") is configs.CONFIGS[()]
    assert configs.table_for((9, 0), "NVIDIA H200") is configs.GPU_CONFIGS["H200"]
    assert configs.table_for((7, 5), "Tesla T4") is configs.CONFIGS[(7, 5)]
    assert configs.table_for((8, 6)) is configs.CONFIGS[()]
    large = 28672 * 8192 // 2
    assert configs.choose_config(large, (9, 0), "NVIDIA H999 141GB") == configs.Config(4096, 8, False)
    # The rows measured on the H100 and the H200 (README, Figures), and where each one ends.
    for gpu in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        assert configs.choose_config(1, (9, 0), gpu) == configs.Config(512, 2, False)
        assert configs.choose_config(1 << 16, (9, 0), gpu) == configs.Config(512, 2, False)
        assert configs.choose_config((1 << 16) + 1, (9, 0), gpu) == configs.Config(1024, 4, True)
        assert configs.choose_config(1 << 21, (9, 0), gpu) == configs.Config(1024, 4, True)
        assert configs.choose_config((1 << 21) + 1, (9, 0), gpu) == configs.Config(2048, 4, True)
        assert configs.choose_config(1 << 26, (9, 0), gpu) == configs.Config(2048, 4, True)
        # fp32 outputs: the same rows up to 64 MiB packed, then 4 KiB tiles over 8 warps.
        assert configs.choose_config(1 << 16, (9, 0), gpu, 4) == configs.Config(512, 2, False)
        assert configs.choose_config(1 << 21, (9, 0), gpu, 4) == configs.Config(1024, 4, True)
        assert configs.choose_config(1 << 26, (9, 0), gpu, 4) == configs.Config(2048, 4, True)
        assert configs.choose_config((1 << 26) + 1, (9, 0), gpu, 4) == configs.Config(4096, 8, True)
    # 16-bit outputs past 64 MiB packed: the H200's own row, the default's elsewhere.
    assert configs.choose_config((1 << 26) + 1, (9, 0), "NVIDIA H200", 2) == configs.Config(4096, 4, True)
    assert configs.choose_config(large, (9, 0), "NVIDIA H200", 2) == configs.Config(4096, 4, True)
    assert configs.choose_config((1 << 26) + 1, (9, 0), "NVIDIA H100 80GB HBM3", 2) == configs.Config(2048, 4, True)
    assert configs.choose_config(large, (9, 0), "NVIDIA H100 80GB HBM3", 2) == configs.Config(2048, 4, True)
    assert configs.choose_config(large, (8, 0), "NVIDIA A100-SXM4-80GB", 2) == configs.Config(2048, 4, True)
    grid, constexprs, num_warps = configs.launch_config(
        28672 * 8192, 64, 256, True, configs.torch.bfloat16, (9, 0), 132, "NVIDIA H100 80GB HBM3"
    )
    assert num_warps == 4 and grid == (-(-large // 2048),) and constexprs["BLOCKS_PER_PROGRAM"] == 2048 // 32
    assert constexprs["EVICT"] == "evict_first"
    grid, constexprs, num_warps = configs.launch_config(
        28672 * 8192, 64, 256, True, configs.torch.float32, (9, 0), 132, "NVIDIA H200"
    )
    assert num_warps == 8 and grid == (-(-large // 4096),) and constexprs["BLOCKS_PER_PROGRAM"] == 4096 // 32
    assert constexprs["PAIR_TYPE"] == configs.tl.uint64
    # Every table ends with a row for any size and any output width.
    for table in (*configs.CONFIGS.values(), *configs.GPU_CONFIGS.values()):
        assert table[-1][0] is None and len(table[-1]) == 2
