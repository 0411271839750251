"""The gateway's uvicorn server: on shutdown it first tells the cluster view, so a
request waiting to resume ends at once with its error (a resume cannot land on a
gateway that is going away), instead of holding uvicorn's graceful wait open until it
cancels the task and the client sees a cut connection."""

from __future__ import annotations

import socket

import uvicorn
from fastapi import FastAPI


class GatewayServer(uvicorn.Server):
    def __init__(self, app: FastAPI, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.gateway_app = app

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.gateway_app.state.gw.cluster.shutting_down = True
        await super().shutdown(sockets)
