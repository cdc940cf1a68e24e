"""A safetensors file is untrusted input: a hostile or garbled header (a length past the file, a
shape its bytes do not hold, negative, textual, overlapping or out-of-file offsets, an unknown
dtype, a header that is not a JSON object) is one line naming the file and the fault, before
anything is allocated; the commands that read one (`sample --hf`, `eval --hf`, `train --init-from`)
exit 2 with it. The fixture's own file (tests/fixtures/hf_gpt2_tiny) is the control.
"""

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from helpers import exits_with_one_line, tensors_of

from jaxpar.core.errors import UserError
from jaxpar.formats.safetensors_mmap import open_safetensors
from jaxpar.sample import main as sample_main

FIXTURE = Path(__file__).parent / "fixtures" / "hf_gpt2_tiny"
F32x4 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}


def write(path: Path, header, data: bytes = b"\0" * 16, length: int | None = None) -> Path:
    """A safetensors file of `header` (an object, or raw bytes) and `data`, its length field
    `length` (default: the header's)."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return path


@pytest.mark.parametrize("header, data, length, expected", [
    ({"w": F32x4}, b"\0" * 16, 2**40,
     "is not a readable safetensors file (its header's length, 1,099,511,627,776 bytes, is past the file)"),
    ({"w": F32x4 | {"shape": [2, 3]}}, b"\0" * 16, None,
     "tensor w has shape [2, 3] of F32, 24 bytes, but its data_offsets span 16"),
    ({"w": F32x4 | {"data_offsets": [-8, 8]}}, b"\0" * 16, None, "tensor w has data_offsets [-8, 8], not [begin, end]"),
    ({"w": F32x4 | {"data_offsets": ["0", "16"]}}, b"\0" * 16, None, 'tensor w has data_offsets ["0", "16"], not'),
    ({"w": F32x4 | {"shape": [True, 4]}}, b"\0" * 16, None, "tensor w has shape [true, 4], not a list of whole"),
    ({"w": F32x4, "v": F32x4 | {"data_offsets": [8, 24]}}, b"\0" * 24, None, "tensors w and v overlap in the data"),
    ({"w": F32x4 | {"shape": [16], "data_offsets": [0, 64]}}, b"\0" * 16, None,
     "is truncated (tensor w ends at byte 64 of the data, which holds 16)"),
    ({"w": F32x4 | {"dtype": "I7"}}, b"\0" * 16, None, 'tensor w has dtype "I7"; jaxpar reads F32, F16, BF16, F64'),
    ({"w": F32x4 | {"dtype": ["F32"]}}, b"\0" * 16, None, 'tensor w has dtype ["F32"]; jaxpar reads'),
    (b"{not json", b"", None, "is not a readable safetensors file (the header is not JSON: Expecting"),
    ([1, 2], b"", None, "(the header is a JSON list, not an object)"),
    ({"w": 5}, b"", None, "tensor w is described by 5, not an object"),
    ({"w\nx": F32x4 | {"dtype": "I7"}}, b"\0" * 16, None, 'tensor "w\\nx" has dtype "I7"'),
], ids=["length-2^40", "shape", "negative", "strings", "bool", "overlap", "past-the-file", "dtype", "dtype-list",
        "not-json", "not-object", "entry", "name"])
def test_a_bad_header_is_one_line_naming_the_file(tmp_path, header, data, length, expected):
    path = write(tmp_path / "model.safetensors", header, data, length)
    with pytest.raises(UserError) as error:
        open_safetensors(path)
    assert str(path) in str(error.value) and expected in str(error.value), error.value
    assert len(str(error.value).splitlines()) == 1


def test_a_header_past_the_limit_is_refused_before_it_is_read(tmp_path):
    """A 150 MB header in a (sparse) 200 MB file: past the safetensors package's 100 MB limit."""
    path = write(tmp_path / "model.safetensors", {}, b"", length=150_000_000)
    with open(path, "r+b") as f:
        f.truncate(200_000_000)
    with pytest.raises(UserError, match=r"its header's length, 150,000,000 bytes, is past the limit of "
                                         r"100,000,000 bytes"):
        open_safetensors(path)


def test_good_files_read_as_the_safetensors_package_reads_them(tmp_path):
    """The control: the fixture, and empty tensors (one with no data bytes at all)."""
    ours = open_safetensors(FIXTURE / "model.safetensors")
    theirs = tensors_of(FIXTURE)
    assert sorted(ours) == sorted(theirs)
    for name, array in theirs.items():
        assert ours[name].dtype == array.dtype and np.array_equal(ours[name], array), name
    both = open_safetensors(write(tmp_path / "a.safetensors", {"w": F32x4, "e": F32x4 | {"shape": [0],
                                                               "data_offsets": [16, 16]}}, b"\1" * 16))
    assert both["w"].shape == (4,) and both["e"].shape == (0,)
    assert open_safetensors(write(tmp_path / "b.safetensors", {"e": F32x4 | {"shape": [0, 3],
                                                               "data_offsets": [0, 0]}}, b""))["e"].shape == (0, 3)


@pytest.fixture
def garbled(tmp_path) -> Path:
    """The fixture's directory whose model.safetensors claims a header of 2^40 bytes."""
    hf_dir = tmp_path / "hf"
    shutil.copytree(FIXTURE, hf_dir)
    write(hf_dir / "model.safetensors", {"w": F32x4}, length=2**40)
    return hf_dir


def test_sample_hf_with_a_garbled_header_is_one_line(garbled, capsys):
    exits_with_one_line(capsys, "jaxpar.sample", lambda: sample_main(["--hf", str(garbled)]),
                        f"'{garbled / 'model.safetensors'}' is not a readable safetensors file (its header's length")


def test_init_from_a_garbled_header_is_one_line_and_writes_nothing(garbled, tmp_path, capsys):
    from helpers import fails_with
    fails_with(capsys, tmp_path, ["--config", "tiny", "--init-from", str(garbled), "--mesh", "dp=-1", "--steps", "2"],
               f"'{garbled / 'model.safetensors'}' is not a readable safetensors file (its header's length")


@pytest.mark.parametrize("weight_map", [["model-1.safetensors"], {"w": 5}])
def test_an_index_whose_weight_map_is_not_names_is_one_line(tmp_path, weight_map):
    from jaxpar.models import hf
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    shutil.copy(FIXTURE / "config.json", hf_dir)
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(UserError, match=r"model.safetensors.index.json': weight_map must map each tensor's name "
                                        r"to its shard's file name"):
        hf.model_overrides_from_hf(hf_dir)
