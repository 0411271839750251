"""One disk-tier entry's files (services/rank/disk_entry.py) as the tier meets them: any
byte flipped, a token changed, a file truncated, half an entry or a sidecar of garbage is
refused with its reason and removed, at scan and at load; a file made for another
placement or cache key is foreign; names, keys and the model fingerprint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from services.rank.disk_tier import (
    DiskEntryError,
    Reject,
    entry_key,
    model_fingerprint,
    placement_name,
)
from tests.support.kv_entries import entry, files, reopen

# -- refusals ------------------------------------------------------------------------------

def _flip(p: Path, at: int) -> None:
    b = bytearray(p.read_bytes())
    b[at] ^= 0x01
    p.write_bytes(bytes(b))


def _bump_token(p: Path) -> None:
    d = json.loads(p.read_text())
    d["tokens"][3] += 1
    p.write_text(json.dumps(d))


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:-100])


TAMPER = {
    "data byte": (lambda f, k: _flip(f / f"{k}.safetensors", -5), Reject.MAC),
    "header byte": (lambda f, k: _flip(f / f"{k}.safetensors", 20), Reject.MAC),
    "sidecar token": (lambda f, k: _bump_token(f / f"{k}.json"), Reject.KEY_MISMATCH),
    "truncated": (lambda f, k: _truncate(f / f"{k}.safetensors"), Reject.SIZE),
    "no sidecar": (lambda f, k: (f / f"{k}.json").unlink(), Reject.ORPHAN),
    "sidecar garbage": (lambda f, k: (f / f"{k}.json").write_text("{not json"), Reject.SIDECAR),
}


@pytest.mark.parametrize("case", sorted(TAMPER))
def test_a_damaged_entry_is_refused_at_scan_and_removed(tiers, case):
    t = tiers()
    key, tokens, cache = entry(40)
    good_key, good_tokens, good = entry(10, seed=1)
    t.write(key, tokens, cache)
    t.write(good_key, good_tokens, good)
    t = reopen(tiers, t)
    damage, _ = TAMPER[case]
    damage(t.folder, key)
    assert list(t.scan()) == [good_key]
    assert t.stats().rejected == 1 and t.stats().entries == 1
    assert files(t.folder) == [f"{good_key}.json", f"{good_key}.safetensors"]
    with pytest.raises(DiskEntryError) as e:
        t.load(key, 40)
    assert e.value.reason is Reject.MISSING


@pytest.mark.parametrize("case", sorted(TAMPER))
def test_damage_after_scan_is_refused_at_load_and_removed(tiers, case):
    t = tiers()
    key, tokens, cache = entry(40)
    t.write(key, tokens, cache)
    t = reopen(tiers, t)
    assert list(t.scan()) == [key]
    damage, reason = TAMPER[case]
    damage(t.folder, key)
    with pytest.raises(DiskEntryError) as e:
        t.load(key, 40)
    assert e.value.reason is reason and e.value.key == key
    assert files(t.folder) == [] and t.stats().rejected == 1 and t.stats().entries == 0


@pytest.mark.parametrize("other", [dict(placement=placement_name(0, 2, 1, 1), rank=1),
                                   dict(key=b"x" * 32)])
def test_a_file_made_for_another_placement_or_cache_key_is_foreign(tiers, tmp_path, other):
    key, tokens, cache = entry(30)
    theirs = tiers(root=tmp_path / "elsewhere", **other)
    theirs.write(key, tokens, cache)
    assert theirs.flush(10)
    t = tiers()
    for n in (f"{key}.json", f"{key}.safetensors"):
        shutil.copy(theirs.folder / n, t.folder / n)
    assert t.scan() == {} and t.stats().rejected == 1 and files(t.folder) == []
    for n in (f"{key}.json", f"{key}.safetensors"):
        shutil.copy(theirs.folder / n, t.folder / n)
    with pytest.raises(DiskEntryError) as e:
        t.load(key, 30)
    assert e.value.reason is Reject.MAC and files(t.folder) == []


# -- identity and budget -------------------------------------------------------------------

def test_the_fingerprint_follows_config_and_weights_only(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text('{"hidden_size": 8}')
    mx.save_safetensors(str(d / "model.safetensors"), {"w": mx.zeros((2, 2))})
    fp = model_fingerprint(d)
    assert len(fp) == 16 and int(fp, 16) >= 0 and model_fingerprint(d) == fp
    (d / "README.md").write_text("unrelated")
    assert model_fingerprint(d) == fp
    mx.save_safetensors(str(d / "model.safetensors"), {"w": mx.ones((2, 2))})
    assert model_fingerprint(d) == fp  # same header and size: weights are never read
    (d / "config.json").write_text('{"hidden_size": 9}')
    fp2 = model_fingerprint(d)
    assert fp2 != fp
    mx.save_safetensors(str(d / "model.safetensors"), {"w": mx.zeros((2, 3))})
    assert model_fingerprint(d) not in (fp, fp2)


def test_names_keys_and_budget():
    assert placement_name(0, 2, 1, 1) == "r0-tp2-pp1-rank1"
    assert entry_key([1, 2, 3]) == entry_key((1, 2, 3)) != entry_key([1, 2, 4])
    assert len(entry_key([])) == 32
    # the budget is the supervisor's (common.rankspec.auto_prompt_cache_disk_bytes)
    from common.rankspec import PROMPT_CACHE_DISK_AUTO_MAX, auto_prompt_cache_disk_bytes
    assert auto_prompt_cache_disk_bytes(10 << 30) == 1 << 30
    assert auto_prompt_cache_disk_bytes(10 << 40) == PROMPT_CACHE_DISK_AUTO_MAX
