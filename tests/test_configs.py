"""Launch configs per GPU: a named GPU's own table, else its compute capability's, else the default."""

from nf4convert.kernels import configs


def test_tables_by_gpu_name_then_capability():
    h200 = configs.table_for((9, 0), "NVIDIA H200")
    assert h200 is configs.GPU_CONFIGS["H200"]
    assert configs.table_for((9, 0), "NVIDIA H100 80GB HBM3") is configs.CONFIGS[()]  # same capability, own table
    assert configs.table_for((7, 5), "Tesla T4") is configs.CONFIGS[(7, 5)]
    assert configs.table_for((8, 6)) is configs.CONFIGS[()]
    large = 28672 * 8192 // 2
    assert configs.choose_config(large, (9, 0), "NVIDIA H200").num_warps == 4
    assert configs.choose_config(large, (9, 0), "NVIDIA H100 80GB HBM3").num_warps == 8
    grid, constexprs, num_warps = configs.launch_config(28672 * 8192, 64, 256, True, configs.torch.bfloat16, (9, 0), 132,
                                                        "NVIDIA H200")  # fmt: skip
    assert num_warps == 4 and grid == (-(-large // 2048),) and constexprs["BLOCKS_PER_PROGRAM"] == 2048 // 32
    # Every table ends with a row for any size.
    for table in (*configs.CONFIGS.values(), *configs.GPU_CONFIGS.values()):
        assert table[-1][0] is None
