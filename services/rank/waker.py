"""Waking the I/O thread from the main thread without handing it the GIL.

`zmq`'s and `os.write`'s wrappers release the GIL around the syscall. On the step path
that is costly: the I/O thread, woken by that very write, grabs the GIL while the main
thread is inside the call and runs its whole turn (signing, sending) before the main
thread gets back to the model. Here the write goes through `ctypes.PyDLL`, which keeps
the GIL: the woken I/O thread waits until the main thread releases the GIL by itself —
inside MLX's eval of the next step — and does its work in parallel with the model.

The read end is a plain file descriptor, polled by the I/O thread's zmq.Poller.
"""

from __future__ import annotations

import ctypes
import os

_ONE = (1).to_bytes(8, "little")


class Waker:
    def __init__(self) -> None:
        if hasattr(os, "eventfd"):
            self.rfd = self.wfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:  # macOS: a pipe
            self.rfd, self.wfd = os.pipe()
            os.set_blocking(self.rfd, False)
            os.set_blocking(self.wfd, False)
        try:
            self._write = ctypes.PyDLL(None).write  # keeps the GIL (PyDLL, not CDLL)
            self._write.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
            self._write.restype = ctypes.c_ssize_t
        except (OSError, AttributeError):
            self._write = None

    def wake(self) -> None:
        if self._write is not None:
            self._write(self.wfd, _ONE, 8)  # full pipe / counter: already awake, fine
            return
        try:
            os.write(self.wfd, _ONE)
        except BlockingIOError:
            pass

    def clear(self) -> None:
        try:
            while os.read(self.rfd, 4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def close(self) -> None:
        for fd in {self.rfd, self.wfd}:
            try:
                os.close(fd)
            except OSError:
                pass
