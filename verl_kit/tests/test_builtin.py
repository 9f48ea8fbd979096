"""``build_once``: a built-in model is built once, and a build that fails leaves nothing behind."""

import pytest

from verl_kit.builtin import build_once


def test_an_entry_is_built_once_and_a_failed_build_leaves_no_partial_entry(tmp_path):
    calls = []

    def build(tmp):
        calls.append(tmp)
        (tmp / "weights.bin").write_bytes(b"x")
        (tmp / "done.json").write_text("{}")

    first = build_once("m", build, done_file="done.json", cache_dir=tmp_path)
    again = build_once("m", build, done_file="done.json", cache_dir=tmp_path)
    assert first == again == tmp_path / "builtin" / "m" and len(calls) == 1
    assert (first / "weights.bin").read_bytes() == b"x"

    def broken(tmp):
        (tmp / "half.bin").write_bytes(b"y")
        raise RuntimeError("killed halfway")

    with pytest.raises(RuntimeError, match="killed halfway"):
        build_once("n", broken, done_file="done.json", cache_dir=tmp_path)
    assert sorted(p.name for p in (tmp_path / "builtin").iterdir()) == [".m.lock", ".n.lock", "m"]
