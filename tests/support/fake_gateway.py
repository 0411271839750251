"""The whole gateway in front of fakes, for the tests of what a model's output becomes:
a real uvicorn server and signed channels, a fake supervisor serving one deployment of a
"thinking" tokenizer (tests/support/thinker_model.py) and a fake rank 0 whose output the
test scripts token by token (`say`); or, with `fake_gateway` alone, any model and
settings."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from common.keys import ensure_cluster_key
from models.tinymodel import build_model
from services.gateway.core.detok import load_tokenizer
from services.gateway.core.settings import GatewaySettings
from tests.fakes.gateway_fakes import FakeRank0, FakeSupervisor
from tests.gwutil import GatewayThread, free_port, poll_until
from tests.support.thinker_model import thinker_model


@contextlib.contextmanager
def fake_gateway(tmp_path_factory, model: Path | None = None, *,
                 supervisor: dict[str, Any] | None = None,
                 **settings: Any) -> Iterator[SimpleNamespace]:
    """The gateway (GatewaySettings `settings`, refresh_s 0.5 unless named) in front of a
    fake supervisor (its extra arguments: `supervisor`) serving one deployment of `model`
    (default: the tiny preset, built here) on a fake rank 0: rank, sup, gw, model,
    settings, key, home, url. Stopped at the end of the block."""
    home = tmp_path_factory.mktemp("gwhome")
    key = ensure_cluster_key(home / "keys" / "cluster.key")
    model = model or build_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny")
    rank = FakeRank0(key).start()
    sup = FakeSupervisor(key, rank, str(model), **(supervisor or {})).start()
    cfg = GatewaySettings(home=home, port=free_port(), admin_endpoint=sup.admin_endpoint,
                          events_endpoint=sup.events_endpoint,
                          **{"refresh_s": 0.5, **settings})
    gw = GatewayThread(cfg, key).start()
    try:
        poll_until(lambda: gw.gw.cluster.backends, 30, "the fake deployment to be picked up")
        yield SimpleNamespace(rank=rank, sup=sup, gw=gw, model=model, settings=cfg, key=key,
                              home=home, url=gw.url)
    finally:
        gw.stop()
        sup.stop()
        rank.stop()


@contextlib.contextmanager
def thinker_gateway(tmp_path_factory, *, coder: bool) -> Iterator[SimpleNamespace]:
    """`fake_gateway` serving a thinking model (with `coder`, Qwen3-Coder's tool format;
    else mlx-lm's json_tools), and its tokenizer as `tok`."""
    tiny = build_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny")
    model = thinker_model(tiny, tmp_path_factory.mktemp("t") / "thinker", coder=coder)
    with fake_gateway(tmp_path_factory, model) as g:
        g.tok = load_tokenizer(model)
        yield g


def say(env, text: str, cached: int | None = None) -> None:
    """Script the fake rank 0 to answer `text` (a `</think>` in it as its special token);
    with `cached`, the prompt tokens it reports served from its prefix cache."""
    tok = env["tok"]
    pieces = text.replace("</think>", "\0</think>\0").split("\0")  # markers as their token
    ids = [i for p in pieces for i in (tok.hf.convert_tokens_to_ids([p]) if p == "</think>"
                                       else tok.encode(p))]
    env["rank"].script = lambda g: list(ids)
    if cached is not None:
        env["rank"].cached = lambda g: cached
