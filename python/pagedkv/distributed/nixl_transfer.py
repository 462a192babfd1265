"""Prefill/decode disaggregation: a decode instance reads a prefill
instance's pages straight out of its pool with NIXL.

The handshake is vLLM's NixlConnector's, over the OpenAI API, so that a
disaggregation proxy written for vLLM drives pagedkv too:

1. The proxy sends the request to a prefill instance with ``max_tokens: 1``
   and ``kv_transfer_params: {"do_remote_decode": true, ...}``.
2. The prefill instance computes the prompt, and when the request ends
   keeps its pages (a fork in its manager, so they stay owned) and answers
   with ``kv_transfer_params``: ``do_remote_prefill: true``,
   ``remote_block_ids`` (the page ids of the prompt's full pages, one list
   per layer group when there are several), ``remote_engine_id``,
   ``remote_host``, ``remote_port`` (its HTTP address, which serves
   ``GET /kv_transfer/metadata``) and ``remote_request_id``.
3. The proxy sends the original request with those params to a decode
   instance. Its scheduler adds the request (local prefix hits first),
   reserves pages for the rest of the prompt's full pages, and reads them
   with one NIXL READ per request from the prefill instance's registered
   pools into its own (no staging copy: both pools are registered as they
   are). The read's completion notice names the request, and the prefill
   instance releases the kept pages; pages nobody reads are released after
   ``hold_seconds``. The decode instance prefills the prompt's last partial
   page itself and decodes on.

Pages the decode instance holds already are not read, nor, in a layer
group with a sliding window, the slots whose pages the prefill instance
has given back. A peer that cannot be reached, or whose pools are laid out
differently, fails the request with a message saying so (`prefetch`, from
the server's handler, before it is submitted); a read that fails releases
the pages reserved for it and drops their keys
(`PagedKVCacheManager.forget`), so nothing half-read is ever served.
`_load_nixl` says how nixl's wheel is made to work beside MAX's own NIXL
core.
"""

from __future__ import annotations

import atexit
import base64
import ctypes
import os
import queue
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..cache.manager import PagedKVCacheManager
from ..graphs.kv_connector import KVConnector, KVTransferError
from .page_layout import page_layout

__all__ = ["NixlPageTransfer", "TransferStats", "check_kv_transfer_params"]

ROLES = ("prefill", "decode")
METADATA_PATH = "/kv_transfer/metadata"


def _load_nixl():
    """nixl's agent and its config class, loaded so that they work beside MAX.

    MAX ships a NIXL core of its own (``libnixl.so``), loaded with MAX, and
    nixl's Python bindings resolve to it by that name; its plugin directory
    holds GPU builds only. The core takes nixl's own plugins (UCX over TCP
    and shared memory) once their helper libraries are loaded globally and
    ``NIXL_PLUGIN_DIR`` names them, before the first agent is made. UCX is
    also told to leave InfiniBand alone on a host without it: probing it
    crashes at exit.
    """
    devices = Path("/sys/class/infiniband")
    if not (devices.is_dir() and any(devices.iterdir())):
        os.environ.setdefault("UCX_MODULES", "^ib,rdmacm")
    import nixl._api as api

    package = api.nixl_agent.__module__.split(".")[0]  # the wheel for this host: nixl_cu13, ...
    root = Path(sys.modules[package].__file__).resolve().parent.parent
    helpers, plugins = root / f".{package}.mesonpy.libs", root / f"{package}.libs" / "nixl"
    if "NIXL_PLUGIN_DIR" not in os.environ and (plugins / "libplugin_UCX.so").is_file():
        for name in ("libserdes.so", "libnixl_build.so", "libnixl_common.so"):
            if (helpers / name).is_file():
                ctypes.CDLL(str(helpers / name), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
        os.environ["NIXL_PLUGIN_DIR"] = str(plugins)
    return api.nixl_agent, api.nixl_agent_config


@dataclass
class TransferStats:
    """Counters since the connector was made (pages count once for all layers)."""

    held: int = 0
    """Requests whose pages are kept for a decode instance now."""
    handed_over: int = 0
    """Requests whose pages a decode instance read (its notice arrived)."""
    expired: int = 0
    """Kept pages released unread after hold_seconds."""
    pulled_pages: int = 0
    pulled_bytes: int = 0
    read_seconds: float = 0.0
    """Time spent in reads (the decode side waits for each)."""
    skipped_pages: int = 0
    """Pages of remote prompts the decode side held already (not read)."""
    failures: int = 0


@dataclass(frozen=True)
class _Peer:
    agent: str
    layers: list[tuple[int, int, int]]
    """Each layer pool's (address, page bytes, pages) on the peer."""
    null_pages: list[int]
    """Each layer group's placeholder page on the peer (a window group's
    slots before its window hold it)."""


def check_kv_transfer_params(params: dict, role: str | None, n: int) -> str | None:
    """Why a request's ``kv_transfer_params`` cannot be served here, or None
    (also None when they ask for no transfer)."""
    remote_decode, remote_prefill = (
        bool(params.get("do_remote_decode")),
        bool(params.get("do_remote_prefill")),
    )
    if not (remote_decode or remote_prefill):
        return None
    if role is None:
        return "this server moves no KV pages: start it with --role prefill or --role decode"
    if n != 1:
        return "kv_transfer_params need n = 1"
    if remote_decode and role != "prefill":
        return "do_remote_decode needs a server started with --role prefill"
    if remote_prefill:
        if role != "decode":
            return "do_remote_prefill needs a server started with --role decode"
        ids = params.get("remote_block_ids")
        lists = ids if ids and isinstance(ids[0], list) else [ids]
        if not isinstance(ids, list) or any(
            not isinstance(x, list) or not all(isinstance(i, int) and i >= 0 for i in x)
            for x in lists
        ):
            return "remote_block_ids must be a list of page ids (one list per layer group)"
        for field, kind in (
            ("remote_host", str),
            ("remote_port", int),
            ("remote_engine_id", str),
            ("remote_request_id", str),
        ):
            if not isinstance(params.get(field), kind):
                return f"kv_transfer_params.{field} must be a {kind.__name__}"
    return None


class NixlPageTransfer(KVConnector):
    """A scheduler connector that keeps pages for, or reads them from,
    another instance over NIXL (see the module docstring).

    Parameters
    ----------
    manager : PagedKVCacheManager
        This instance's pages (host pools: NumPy arrays or CPU torch tensors).
    role : str
        "prefill" (keeps pages for decode instances) or "decode" (reads them).
    model_id : str
        What computes the pages; a peer must name the same model and layout.
    host, port : str, int
        The HTTP address a decode instance reaches this one at (its metadata).
    hold_seconds : float
        How long a prefill instance keeps pages nobody has read.
    transfer_timeout : float
        Seconds a read may take before the request fails.
    peer_metadata : callable(host, port) -> dict, optional
        How a decode instance gets a peer's `metadata()` (default: HTTP GET
        of ``http://host:port/kv_transfer/metadata``).
    progress_thread : bool
        Run nixl's own progress thread, which busy-polls a core for good.
        Without it (the default) a reader progresses its read while it waits
        for it, and an owner of kept pages (a prefill instance) progresses
        its agent from a thread of its own every `progress_interval` seconds
        while it keeps any: reads over UCX's TCP and shared-memory transports
        need the owner's progress, RDMA reads do not.
    progress_interval : float
        The owner's progress period.

    Examples
    --------
    >>> prefill = NixlPageTransfer(manager_a, "prefill", "demo", port=8001)  # doctest: +SKIP
    >>> decode = NixlPageTransfer(manager_b, "decode", "demo")  # doctest: +SKIP
    """

    def __init__(
        self,
        manager: PagedKVCacheManager,
        role: str,
        model_id: str,
        host: str = "127.0.0.1",
        port: int = 0,
        hold_seconds: float = 120.0,
        transfer_timeout: float = 30.0,
        peer_metadata=None,
        progress_thread: bool = False,
        progress_interval: float = 0.0005,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        nixl_agent, nixl_agent_config = _load_nixl()
        self.manager = manager
        self.role = self.transfer_role = role
        self.layout = page_layout(manager, model_id)
        self.engine_id = uuid.uuid4().hex
        self.host, self.port = host, port
        self.hold_seconds = hold_seconds
        self.transfer_timeout = transfer_timeout
        self._peer_metadata = peer_metadata or _http_metadata
        config = nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
        self.agent = nixl_agent(f"pagedkv-{self.engine_id}", config)
        self.layers = [_region(pool) for pool in manager.pools]
        self._registered = self.agent.register_memory(
            [(address, page_bytes * pages, 0, "") for address, page_bytes, pages in self.layers],
            "DRAM",
        )
        self._holds: dict[str, tuple[str, float]] = {}
        self._peers: dict[str, _Peer] = {}
        self._fetched: dict[str, dict] = {}
        self._fetched_lock = threading.Lock()
        self.stats = TransferStats()
        self.progress_interval = progress_interval
        self._notices: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._reading = threading.Event()
        self._closed = False
        self._thread = None
        if role == "prefill":
            self._thread = threading.Thread(target=self._progress, name="pagedkv-nixl", daemon=True)
            self._thread.start()
        _LIVE.add(self)
        # Made once: the HTTP thread serves it while the engine thread uses
        # the agent, which is not thread-safe.
        self._metadata = {
            "engine_id": self.engine_id,
            "agent_name": self.agent.name,
            "agent_metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
            "layout": self.layout,
            "layers": [list(layer) for layer in self.layers],
            "null_pages": [int(page) for page in manager.null_pages],
        }

    @property
    def busy(self) -> bool:
        return bool(self._holds)

    def metadata(self) -> dict:
        """What a decode instance needs to read this one's pages (JSON; any thread)."""
        return dict(self._metadata)

    # ------------------------------------------------------------ prefill side

    def on_finish(self, request, seq_id: Hashable) -> dict | None:
        params = getattr(request, "kv_transfer", None)
        if self.role != "prefill" or not params or not params.get("do_remote_decode"):
            return None
        m = self.manager
        hold = f"kv-transfer:{request.request_id}"
        full = (len(request.prompt) - 1) // m.page_size  # the decode side computes the rest
        m.fork(seq_id, hold)
        self._holds[request.request_id] = (hold, time.monotonic() + self.hold_seconds)
        self._reading.set()
        self.stats.held = len(self._holds)
        pages = [m.pages(hold, g)[:full].tolist() for g in range(len(m.layer_groups))]
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": pages[0] if len(pages) == 1 else pages,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_request_id": request.request_id,
            "tp_size": 1,
        }

    def poll(self) -> None:
        """Releases the pages whose reader's notice arrived, or whose time is up."""
        if not self._holds:
            return
        while not self._notices.empty():
            if self._release(self._notices.get()):
                self.stats.handed_over += 1
        now = time.monotonic()
        for rid in [r for r, (_, deadline) in self._holds.items() if deadline < now]:
            self._release(rid)
            self.stats.expired += 1

    def _release(self, request_id: str) -> bool:
        held = self._holds.pop(request_id, None)
        if held is not None:
            self.manager.release(held[0])
        self.stats.held = len(self._holds)
        if not self._holds:
            self._reading.clear()
        return held is not None

    def _progress(self) -> None:
        """The owner's side of reads (its own thread): while pages are kept,
        progresses the agent every `progress_interval` seconds and queues
        the readers' notices for poll(). The scheduler's thread touches the
        agent no more once it is made, so the two never share it."""
        while not self._closed:
            if not self._reading.wait(0.5):
                continue
            agent = self.agent
            if agent is None:
                return
            for messages in agent.get_new_notifs().values():
                for message in messages:
                    self._notices.put(message.decode(errors="replace"))
            time.sleep(self.progress_interval)

    def close(self) -> None:
        """Stops the owner's progress thread and lets the agent go. At exit
        every connector is closed first: an agent torn down while a thread
        is inside nixl, or after UCX's own teardown, aborts the process."""
        self._closed = True
        self._reading.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2.0)
        self.agent = None

    # ------------------------------------------------------------- decode side

    def fetch(
        self, request_id: Hashable, tokens: Sequence[int], cached_tokens: int, request=None
    ) -> int:
        params = getattr(request, "kv_transfer", None)
        if self.role != "decode" or not params or not params.get("do_remote_prefill"):
            return cached_tokens
        if len(tokens) != len(request.prompt) - 1:
            # A preempted sample coming back (prompt and tokens so far): the
            # peer released its pages at the first read, so it recomputes.
            return cached_tokens
        m = self.manager
        size = m.page_size
        remote = params["remote_block_ids"]
        remote = remote if remote and isinstance(remote[0], list) else [remote]
        full, first = len(tokens) // size, cached_tokens // size
        if len(remote) != len(m.layer_groups) or any(len(r) < full for r in remote):
            raise KVTransferError(
                f"kv_transfer_params name {[len(r) for r in remote]} pages per layer group; "
                f"the prompt has {full} full pages in {len(m.layer_groups)} group(s)"
            )
        peer = self._peer(params)
        rid = str(params["remote_request_id"]).encode()
        count = full - first
        self.stats.skipped_pages += min(first, full)
        if count <= 0:
            try:  # every page is here: the notice only frees the peer's sooner
                self.agent.send_notif(peer.agent, rid)
            except Exception:  # nixl raises its own error types
                self._forget_peer(params["remote_engine_id"])
            return cached_tokens
        skipped = self._window_slots(peer, remote, first, full)
        m.reserve([request_id], count * size)
        t0 = time.perf_counter()
        try:
            moved = self._read(peer, request_id, remote, first, count, rid, skipped)
        except KVTransferError:
            m.forget(request_id, cached_tokens)
            self.stats.failures += 1
            self._forget_peer(params["remote_engine_id"])
            raise
        for g, stop in enumerate(skipped):
            if stop > first:  # slots the window no longer shows: not read, not cached
                m.forget(request_id, first * size, stop * size, groups=[g])
        self.stats.pulled_pages += count
        self.stats.pulled_bytes += moved
        self.stats.read_seconds += time.perf_counter() - t0
        return cached_tokens + count * size

    def prefetch(self, params: dict) -> str | None:
        """Fetches and checks the metadata of the prefill instance the params
        name, for the scheduler's thread to find ready; returns why it cannot
        be used, or None. Any thread (the server calls it before it submits
        a request, so that the scheduler never waits on HTTP)."""
        try:
            self._metadata_of(params)
        except KVTransferError as e:
            return str(e)
        return None

    def _metadata_of(self, params: dict) -> dict:
        """The peer's checked metadata (cached by engine id; any thread)."""
        engine = params["remote_engine_id"]
        with self._fetched_lock:
            meta = self._fetched.get(engine)
        if meta is not None:
            return meta
        host, port = params["remote_host"], params["remote_port"]
        try:
            meta = self._peer_metadata(host, port)
        except Exception as e:
            raise KVTransferError(
                f"cannot reach the prefill instance at {host}:{port} ({type(e).__name__}: {e})"
            ) from None
        if meta.get("engine_id") != engine:
            raise KVTransferError(
                f"the prefill instance at {host}:{port} is not engine {engine} (restarted?)"
            )
        if meta.get("layout") != self.layout:
            raise KVTransferError(
                f"the prefill instance at {host}:{port} lays out pages as {meta.get('layout')!r}, "
                f"this one as {self.layout!r}"
            )
        with self._fetched_lock:
            self._fetched[engine] = meta
        return meta

    def _peer(self, params: dict) -> _Peer:
        """The peer as the agent knows it (the scheduler's thread only)."""
        engine = params["remote_engine_id"]
        peer = self._peers.get(engine)
        if peer is not None:
            return peer
        try:
            meta = self._metadata_of(params)
        except KVTransferError:
            self.stats.failures += 1
            raise
        self.agent.add_remote_agent(base64.b64decode(meta["agent_metadata"]))
        layers = [tuple(x) for x in meta["layers"]]
        peer = self._peers[engine] = _Peer(meta["agent_name"], layers, list(meta["null_pages"]))
        return peer

    def _forget_peer(self, engine: str) -> None:
        """A peer that failed is asked for its metadata again next time."""
        self._peers.pop(engine, None)
        with self._fetched_lock:
            self._fetched.pop(engine, None)

    def _window_slots(self, peer: _Peer, remote, first: int, full: int) -> list[int]:
        """Per layer group, the slot before which the peer holds no page (a
        window group's slots its window passed hold the placeholder page; 0
        for full attention): those are not read. Every page the peer still
        holds is, so that later prompts sharing a shorter prefix find their
        window here too. Raises KVTransferError when the peer lacks a page a
        query of the decode side will see."""
        m, size = self.manager, self.manager.page_size
        stops = []
        for g, (_, window) in enumerate(m.layer_groups):
            stop = 0
            if window is not None:
                null = peer.null_pages[g]
                while stop < full and remote[g][stop] == null:
                    stop += 1
                if stop > max(0, (full * size - window + 1) // size):
                    raise KVTransferError(
                        f"the prefill instance no longer holds the window's pages of "
                        f"layer group {g}"
                    )
            stops.append(stop)
        return stops

    def _read(
        self, peer: _Peer, request_id, remote, first: int, count: int, note: bytes, skipped
    ) -> int:
        """One READ of slots first .. first + count - 1 of every layer (from
        skipped[g] on in layer group g); the bytes moved."""
        m = self.manager
        local_pages = [m.pages(request_id, g) for g in range(len(m.layer_groups))]
        local, far = [], []
        for layer, ((address, page_bytes, _), (base, remote_bytes, remote_pages)) in enumerate(
            zip(self.layers, peer.layers, strict=True)
        ):
            g = m.group_of_layer[layer]
            for slot in range(max(first, skipped[g]), first + count):
                page = int(remote[g][slot])
                if remote_bytes != page_bytes or page >= remote_pages:
                    raise KVTransferError(f"remote page {page} is not in the peer's pool")
                local.append((address + int(local_pages[g][slot]) * page_bytes, page_bytes, 0))
                far.append((base + page * page_bytes, page_bytes, 0))
        agent = self.agent
        if not local:
            agent.send_notif(peer.agent, note)
            return 0
        try:
            handle = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(local, "DRAM"),
                agent.get_xfer_descs(far, "DRAM"),
                peer.agent,
                note,
            )
            state = agent.transfer(handle)
            deadline = time.monotonic() + self.transfer_timeout
            while state == "PROC" and time.monotonic() < deadline:
                state = agent.check_xfer_state(handle)
            handle.release()
        except Exception as e:  # nixl raises its own error types
            raise KVTransferError(
                f"cannot read pages from the prefill instance ({type(e).__name__}: {e})"
            ) from None
        if state != "DONE":
            raise KVTransferError(f"the read of pages from the prefill instance ended in {state}")
        return sum(length for _, length, _ in local)


_LIVE: weakref.WeakSet[NixlPageTransfer] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for connector in list(_LIVE):
        connector.close()


def _region(pool) -> tuple[int, int, int]:
    """A host pool's (address, page bytes, pages)."""
    if hasattr(pool, "data_ptr"):
        if pool.device.type != "cpu":
            raise ValueError("NIXL page transfer here reads host pools only")
        address, nbytes = pool.data_ptr(), pool.numel() * pool.element_size()
    else:
        address, nbytes = pool.ctypes.data, pool.nbytes
    return int(address), nbytes // pool.shape[0], int(pool.shape[0])


def _http_metadata(host: str, port: int) -> dict:
    import httpx

    answer = httpx.get(f"http://{host}:{port}{METADATA_PATH}", timeout=5.0)
    answer.raise_for_status()
    return answer.json()
