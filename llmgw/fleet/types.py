"""What the router and the agents say to each other about engines: the spec of a replica the
router wants run (sent in `desired`), and an agent's report of one engine it runs."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = ["ENGINE_STATES", "KV_FOLLOWED_STATES", "RUNNING_STATES", "EngineReport", "EngineSpec", "EngineState",
           "GpuInfo", "GroupLaunch", "LoraLaunch", "NodeFacts", "RouterAddr"]

EngineState = Literal["starting", "ready", "unhealthy", "crashed", "failed", "crashloop", "stopping", "stopped"]
ENGINE_STATES: tuple[str, ...] = ("starting", "ready", "unhealthy", "crashed", "failed", "crashloop",
                                  "stopping", "stopped")
# States in which the engine process exists (and holds its GPUs and port).
RUNNING_STATES = frozenset({"starting", "ready", "unhealthy", "stopping"})
# States in which an agent follows an engine's KV events, so the router keeps its replica's tier-2
# index (an unhealthy engine is withdrawn from routing but still holds, and reports, its blocks).
KV_FOLLOWED_STATES = frozenset({"starting", "ready", "unhealthy"})


def _port_or_none(v: Any) -> int | None:
    """A TCP port from an agent's report, or None when absent or not one (never trusted as is)."""
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 < v < 65536 else None


@dataclass(frozen=True)
class LoraLaunch:
    """An engine's LoRA setup at start (the command line is :mod:`llmgw.fleet.engine_cmd`'s). vLLM:
    LoRA on, ``max_loras`` adapters per batch, ranks up to ``max_rank``, ``adapters`` the static ones
    (the rest are loaded at runtime). llama.cpp: ``adapters`` is every declared one, each loaded off
    (scale 0) — its position is its id; ``max_loras``/``max_rank`` are 0 (not llama.cpp's)."""

    max_loras: int = 0
    max_rank: int = 0
    adapters: tuple[tuple[str, str], ...] = ()  # (name, source): loaded at start, in this order

    def to_wire(self) -> dict[str, Any]:
        return {"max_loras": self.max_loras, "max_rank": self.max_rank,
                "adapters": [[name, source] for name, source in self.adapters]}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> LoraLaunch:
        return cls(max_loras=int(d.get("max_loras", 0)), max_rank=int(d.get("max_rank", 0)),
                   adapters=tuple((str(n), str(s)) for n, s in d.get("adapters", ())))


@dataclass(frozen=True)
class GroupLaunch:
    """One node's part of a multi-node replica (docs/placement.md, "Multi-node replicas"). The head
    (rank 0) serves and is the replica (``group`` is its replica id); each worker (rank 1..size-1)
    runs the engine's worker process on its node. The head is told its workers' addresses
    (``peers``, host:port in rank order) once they all run; until then it is not started."""

    role: str  # "head" | "worker"
    group: str  # the head's replica id
    rank: int
    size: int
    peers: tuple[str, ...] = ()  # head only: the workers' host:port, rank 1 first

    def to_wire(self) -> dict[str, Any]:
        return {"role": self.role, "group": self.group, "rank": self.rank, "size": self.size,
                "peers": list(self.peers)}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> GroupLaunch:
        return cls(role=str(d["role"]), group=str(d["group"]), rank=int(d["rank"]), size=int(d["size"]),
                   peers=tuple(str(p) for p in d.get("peers", ())))


@dataclass(frozen=True)
class EngineSpec:
    """One replica the router wants an agent to run. `generation` is bumped by an operator to
    restart the engine or to clear its crash loop; any other change means a different engine."""

    replica: str  # unique id, e.g. "llama-8b/3f9a1c"
    model: str  # the name it serves (vLLM --served-model-name, llama.cpp --alias)
    engine: str  # "vllm" | "llamacpp": the API flavour and metric contract
    model_path: str  # vLLM: HF id or path; llama.cpp: .gguf path; simulator: anything
    simulate: bool = False  # run `llmgw sim --engine <engine>` instead of the real binary
    binary: str | None = None  # default: "vllm" / "llama-server" on PATH
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    gpu_indices: tuple[int, ...] = ()  # → CUDA_VISIBLE_DEVICES
    health_timeout_s: float = 600.0
    generation: int = 0
    kv_events: bool = False  # vLLM publishes KV cache events (the agent picks the endpoints)
    lora: LoraLaunch | None = None  # the model declares LoRA adapters
    group: GroupLaunch | None = None  # a part of a multi-node replica
    # a disaggregated model's group ([[models.deploy.roles]]): "prefill" or "decode"; "" outside one.
    # The agent runs it as any engine (the group's args carry the engine's KV-transfer flags); the
    # router routes it with this role.
    role: str = ""

    @property
    def is_worker(self) -> bool:
        return self.group is not None and self.group.role == "worker"

    def spec_hash(self) -> str:
        """Identity of the engine process: everything but `generation`."""
        d = self.to_wire()
        d.pop("generation")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def to_wire(self) -> dict[str, Any]:
        # By hand, not dataclasses.asdict: its deep copy was a quarter of placing 2,000 replicas.
        return {"replica": self.replica, "model": self.model, "engine": self.engine, "model_path": self.model_path,
                "simulate": self.simulate, "binary": self.binary, "args": list(self.args),
                "env": [list(kv) for kv in self.env], "gpu_indices": list(self.gpu_indices),
                "health_timeout_s": self.health_timeout_s, "generation": self.generation,
                # only when on: the spec_hash of every engine without it stays as it was (no restarts)
                **({"kv_events": True} if self.kv_events else {}),
                **({"lora": self.lora.to_wire()} if self.lora is not None else {}),
                **({"group": self.group.to_wire()} if self.group is not None else {}),
                **({"role": self.role} if self.role else {})}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> EngineSpec:
        return cls(replica=d["replica"], model=d["model"], engine=d["engine"], model_path=d["model_path"],
                   simulate=bool(d.get("simulate", False)), binary=d.get("binary"),
                   args=tuple(d.get("args", ())), env=tuple((str(k), str(v)) for k, v in d.get("env", ())),
                   gpu_indices=tuple(int(i) for i in d.get("gpu_indices", ())),
                   health_timeout_s=float(d.get("health_timeout_s", 600.0)),
                   generation=int(d.get("generation", 0)), kv_events=bool(d.get("kv_events", False)),
                   lora=LoraLaunch.from_wire(d["lora"]) if isinstance(d.get("lora"), dict) else None,
                   group=GroupLaunch.from_wire(d["group"]) if isinstance(d.get("group"), dict) else None,
                   role=str(d.get("role", "")))


@dataclass
class EngineReport:
    """An agent's account of one engine. Sent whole on every change and in every hello."""

    replica: str
    model: str
    state: str  # one of ENGINE_STATES
    spec_hash: str = ""
    generation: int = 0
    url: str | None = None  # where the router reaches it, once it listens
    pid: int | None = None
    restarts: int = 0
    detail: str = ""  # why: exit status, health deadline, crash loop ...
    log_tail: tuple[str, ...] = ()  # the engine's last output lines when it failed or crashed
    adopted: bool = False  # found running from an earlier agent run and kept
    # kv_events engines: where the engine's KV-event PUB and replay ROUTER are bound (local only)
    kv_endpoint: str | None = None
    kv_replay: str | None = None
    # a vLLM multi-node head: the port of its Ray head (GCS) on the report URL's host, which its
    # workers join (docs/placement.md, "vLLM multi-node replicas")
    group_port: int | None = None
    # The engine's whole spec, in the hello only: a router whose store does not know the engine
    # (deleted, replaced) can keep it running, or adopt it, instead of having it stopped.
    spec: EngineSpec | None = None

    def to_wire(self) -> dict[str, Any]:
        d = asdict(self)
        d["log_tail"] = list(self.log_tail)
        for key in ("kv_endpoint", "kv_replay", "group_port"):  # optional on the wire: absent when off
            if d[key] is None:
                del d[key]
        if self.spec is None:
            del d["spec"]
        else:
            d["spec"] = self.spec.to_wire()
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> EngineReport:
        return cls(replica=d["replica"], model=d["model"], state=d["state"], spec_hash=d.get("spec_hash", ""),
                   generation=int(d.get("generation", 0)), url=d.get("url"), pid=d.get("pid"),
                   restarts=int(d.get("restarts", 0)), detail=d.get("detail", ""),
                   log_tail=tuple(d.get("log_tail", ())), adopted=bool(d.get("adopted", False)),
                   kv_endpoint=d.get("kv_endpoint"), kv_replay=d.get("kv_replay"),
                   group_port=_port_or_none(d.get("group_port")),
                   spec=EngineSpec.from_wire(d["spec"]) if isinstance(d.get("spec"), dict) else None)


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    memory_mb: int


@dataclass(frozen=True)
class NodeFacts:
    """What an agent found on its node (GPUs from nvidia-smi when present)."""

    cpus: int = 0
    memory_mb: int = 0
    gpus: tuple[GpuInfo, ...] = ()
    hostname: str = ""
    agent_version: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    declared_watts: int = 0  # the node's own power figure ([agent] declared_watts); 0: none
    measured_watts: float | None = None  # the sum of nvidia-smi power.draw, where the agent could read it

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "cpus": self.cpus, "memory_mb": self.memory_mb, "hostname": self.hostname,
            "agent_version": self.agent_version,
            "gpus": [{"index": g.index, "name": g.name, "memory_mb": g.memory_mb} for g in self.gpus]}
        if self.declared_watts:  # only when known: a router that predates them reads the rest as before
            d["declared_watts"] = self.declared_watts
        if self.measured_watts is not None:
            d["measured_watts"] = self.measured_watts
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> NodeFacts:
        return cls(cpus=int(d.get("cpus", 0)), memory_mb=int(d.get("memory_mb", 0)),
                   hostname=str(d.get("hostname", "")), agent_version=str(d.get("agent_version", "")),
                   gpus=tuple(GpuInfo(int(g["index"]), str(g.get("name", "")), int(g.get("memory_mb", 0)))
                              for g in d.get("gpus", ())),
                   declared_watts=int(d.get("declared_watts", 0)),
                   measured_watts=float(d["measured_watts"]) if d.get("measured_watts") is not None else None)


@dataclass(frozen=True)
class RouterAddr:
    """One live router, as the routers tell their agents (a welcome's and a `routers` message's
    `routers`): its id, the control address agents dial ("host:port"), and its TLS pin — the CA
    that signed its control certificate (PEM; "" for a plain-TCP listener or one whose certificate
    the agent's own CA settings cover) and the name to verify ("": the address's host)."""

    id: str
    control: str
    ca_pem: str = ""
    server_name: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {"id": self.id, "control": self.control, "ca_pem": self.ca_pem, "server_name": self.server_name}
