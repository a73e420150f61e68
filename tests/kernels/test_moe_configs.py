"""Config table: nearest-batch lookup, defaults, the file format, and the table shipped in the package."""

from __future__ import annotations

import importlib.resources
import json

import pytest
import torch

from locus.kernels.moe_configs import (
    MoeConfig,
    config_file_name,
    default_config,
    get_config,
    load_table,
    pick_nearest,
    write_table,
)

SMALL, MID, BIG = MoeConfig(block_m=16), MoeConfig(block_m=32), MoeConfig(block_m=128)


def test_nearest_batch_on_log_scale():
    table = {1: SMALL, 64: MID, 4096: BIG}
    assert pick_nearest(table, 1) is SMALL
    assert pick_nearest(table, 8) is SMALL  # log-equidistant from 1 and 64: the smaller batch wins
    assert pick_nearest(table, 9) is MID
    assert pick_nearest(table, 500) is MID
    assert pick_nearest(table, 600) is BIG
    assert pick_nearest(table, 10**6) is BIG
    assert pick_nearest(table, 0) is SMALL


def test_table_round_trip_and_lookup(tmp_path):
    table = {1: SMALL, 256: MID, 8192: BIG}
    path = write_table(tmp_path, 16, 8192, 5120, torch.bfloat16, "NVIDIA H200", table, {"tool": "test"})
    assert path.name == config_file_name(16, 8192, 5120, torch.bfloat16, "NVIDIA H200")
    assert path.name == "E16_I8192_H5120_bfloat16_NVIDIA_H200.json"
    data = json.loads(path.read_text())
    assert data["format"] == "locus-moe-configs" and data["version"] == 1 and data["E"] == 16
    assert load_table(tmp_path, path.name) == table
    lookup = lambda T, dtype=torch.bfloat16: get_config(T, 1, 16, 8192, 5120, dtype, "NVIDIA H200", tmp_path)  # noqa: E731
    assert lookup(3) == SMALL and lookup(300) == MID and lookup(16384) == BIG
    # no fp16 table: the default, which knows the expert shape (it may split a decode batch's reduction)
    assert lookup(3, torch.float16) == default_config(3, 1, 16, torch.float16, "NVIDIA H200", I=8192, H=5120)


def test_tables_are_keyed_by_the_weight_format(tmp_path):
    """Narrow weights read other bytes per tile: their tables are their own (the format in the dtype
    field of the name); float weights keep theirs, and a file written before formats still loads."""
    fp8_table, float_table = {1: SMALL, 4096: BIG}, {1: MID}
    path = write_table(tmp_path, 16, 8192, 5120, torch.bfloat16, "NVIDIA H100", fp8_table, weights="fp8")
    assert path.name == "E16_I8192_H5120_fp8_NVIDIA_H100.json"
    data = json.loads(path.read_text())
    assert data["weights"] == "fp8" and data["dtype"] == "bfloat16"
    old = {"format": "locus-moe-configs", "version": 1, "E": 16, "I": 8192, "H": 5120, "dtype": "bfloat16",
           "device": "NVIDIA H100", "configs": {"1": MID.to_json()}}  # no "weights": bfloat16 weights
    (tmp_path / config_file_name(16, 8192, 5120, torch.bfloat16, "NVIDIA H100")).write_text(json.dumps(old))
    lookup = lambda T, weights=None: get_config(T, 1, 16, 8192, 5120, torch.bfloat16, "NVIDIA H100", tmp_path,  # noqa: E731
                                                weights=weights)
    assert lookup(1, "fp8") == SMALL and lookup(5000, "fp8") == BIG
    assert lookup(1) == float_table[1] and lookup(1, "float") == float_table[1]
    assert lookup(1, "mxfp4") == default_config(1, 1, 16, torch.bfloat16, "NVIDIA H100", I=8192, H=5120)


def test_bad_table_is_rejected(tmp_path):
    name = config_file_name(4, 64, 32, torch.float32, "cpu")
    (tmp_path / name).write_text(json.dumps({"format": "something-else", "version": 1}))
    with pytest.raises(ValueError, match="not a locus-moe-configs"):
        load_table(tmp_path, name)
    (tmp_path / name).write_text(json.dumps({"format": "locus-moe-configs", "version": 1,
                                             "configs": {"1": {"block_m": 24}}}))
    load_table.cache_clear()
    with pytest.raises(ValueError, match="bad configs entry"):
        load_table(tmp_path, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 64, 16384])
def test_defaults_are_valid_and_scale_with_the_batch(dtype, T):
    config = default_config(T, 1, 16, dtype, "NVIDIA H200")
    itemsize = torch.finfo(dtype).bits // 8
    assert config.num_stages * (config.block_m * config.block_k + 2 * config.block_k * config.block_n) * itemsize <= 227 * 1024
    if T == 1:
        assert config.block_m == 16
    if T == 16384:
        assert config.block_m >= 64


def test_config_validation():
    with pytest.raises(ValueError, match="power of two"):
        MoeConfig(block_m=24)
    with pytest.raises(ValueError, match="power of two"):
        MoeConfig(block_k=8)
    with pytest.raises(ValueError, match="positive"):
        MoeConfig(group_m=0)


def test_shipped_table_is_package_data():
    """The tiny preset's experts (E=8, I=H=64, fp32) have an interpreter table shipped with the package."""
    name = config_file_name(8, 64, 64, torch.float32, "cpu")
    resource = importlib.resources.files("locus.kernels") / "configs" / name
    assert resource.is_file()
    table = load_table(resource.parent, name)
    assert table and get_config(1, 2, 8, 64, 64, torch.float32, "cpu") == pick_nearest(table, 1)
