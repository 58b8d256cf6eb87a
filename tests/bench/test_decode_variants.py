"""``bench/decode.py``'s variant names and what each sets up."""

from __future__ import annotations

import pytest

from bench.decode_args import Sweep, parse_args
from bench.decode_variants import parse_variant


def test_plain_variants_keep_the_first_graphs() -> None:
    sync, run_async = parse_variant("sync"), parse_variant("async")
    assert (sync.async_scheduling, run_async.async_scheduling) == (False, True)
    assert not sync.recaptured and not run_async.recaptured
    assert run_async.runs(256)


def test_skinny_variants_run_small_batches_on_new_graphs() -> None:
    skinny, every = parse_variant("skinny"), parse_variant("skinny-all")
    assert skinny.recaptured and skinny.skinny_projections == {"qkv", "o"}
    assert every.skinny_projections == {"qkv", "o", "gate_up", "down"}
    assert skinny.runs(64) and not skinny.runs(128)


def test_prefetch_variants_name_their_targets_and_priority() -> None:
    both = parse_variant("prefetch-o+kv-el")
    assert both.prefetch.targets == {"o", "kv"} and both.prefetch.evict_last
    assert both.async_scheduling and both.recaptured and both.runs(256)
    only_o = parse_variant("prefetch-o")
    assert only_o.prefetch.targets == {"o"} and not only_o.prefetch.evict_last


@pytest.mark.parametrize("name", ["prefetch-", "prefetch-qkv", "fast", "prefetch-o-el-el"])
def test_unknown_variants_are_refused_by_name(name: str) -> None:
    with pytest.raises(ValueError, match=repr(name).replace("+", r"\+")):
        parse_variant(name)
    with pytest.raises(ValueError, match="variant"):
        Sweep.from_args(parse_args(["--variants", f"async,{name}"]))
