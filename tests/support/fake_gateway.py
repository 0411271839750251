"""The whole gateway in front of fakes, for the tests of what a model's output becomes:
a real uvicorn server and signed channels, a fake supervisor serving one deployment of a
"thinking" tokenizer (tests/support/thinker_model.py) and a fake rank 0 whose output the
test scripts token by token (`say`); or, with `fake_gateway` alone, any model and
settings. Tests see either as a `FakeGateway`, or, with an SDK client of it, as a
`FakeGatewayClient`."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from common.envelope import Key
from common.keys import ensure_cluster_key
from models.tinymodel import build_model
from services.gateway.core.detok import ModelTokenizer, load_tokenizer
from services.gateway.core.settings import GatewaySettings
from tests.fakes.gateway_fakes import FakeRank0, FakeSupervisor
from tests.gwutil import GatewayThread, free_port, poll_until
from tests.support.thinker_model import thinker_model

C = TypeVar("C")


@dataclass(frozen=True)
class FakeGateway:
    """A running gateway (`gw`, at `url`, with `settings`) in front of the fake supervisor
    `sup` serving one deployment of `model` on the fake rank 0 `rank`, all under `key`."""

    rank: FakeRank0
    sup: FakeSupervisor
    gw: GatewayThread
    model: Path
    settings: GatewaySettings
    key: Key
    home: Path
    url: str

    @property
    def model_name(self) -> str:
        """The served model's name, as requests name it."""
        return self.model.name

    @property
    def tok(self) -> ModelTokenizer:
        """The served model's tokenizer (loaded once per model)."""
        return load_tokenizer(self.model)

    def with_client(self, c: C) -> FakeGatewayClient[C]:
        """This gateway and `c`, an SDK client of it."""
        return FakeGatewayClient(**{f.name: getattr(self, f.name)
                                    for f in dataclasses.fields(self)}, c=c)


@dataclass(frozen=True)
class FakeGatewayClient(FakeGateway, Generic[C]):
    """A `FakeGateway` and `c`, an SDK client of it (openai.OpenAI, anthropic.Anthropic)."""

    c: C


@contextlib.contextmanager
def fake_gateway(tmp_path_factory, model: Path | None = None, *,
                 supervisor: dict[str, Any] | None = None,
                 **settings: Any) -> Iterator[FakeGateway]:
    """The gateway (GatewaySettings `settings`, refresh_s 0.5 unless named) in front of a
    fake supervisor (its extra arguments: `supervisor`) serving one deployment of `model`
    (default: the tiny preset, built here) on a fake rank 0. Stopped at the end of the
    block."""
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
        yield FakeGateway(rank=rank, sup=sup, gw=gw, model=model, settings=cfg, key=key,
                          home=home, url=gw.url)
    finally:
        gw.stop()
        sup.stop()
        rank.stop()


@contextlib.contextmanager
def thinker_gateway(tmp_path_factory, *, coder: bool) -> Iterator[FakeGateway]:
    """`fake_gateway` serving a thinking model (with `coder`, Qwen3-Coder's tool format;
    else mlx-lm's json_tools)."""
    tiny = build_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny")
    model = thinker_model(tiny, tmp_path_factory.mktemp("t") / "thinker", coder=coder)
    with fake_gateway(tmp_path_factory, model) as g:
        load_tokenizer(model)  # loaded (and kept) before the tests run
        yield g


def say(env: FakeGateway, text: str, cached: int | None = None) -> None:
    """Script the fake rank 0 to answer `text` (a `</think>` in it as its special token);
    with `cached`, the prompt tokens it reports served from its prefix cache."""
    tok = env.tok
    pieces = text.replace("</think>", "\0</think>\0").split("\0")  # markers as their token
    ids = [i for p in pieces for i in (tok.hf.convert_tokens_to_ids([p]) if p == "</think>"
                                       else tok.encode(p))]
    env.rank.script = lambda g: list(ids)
    if cached is not None:
        env.rank.cached = lambda g: cached
