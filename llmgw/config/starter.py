"""The commented starter file `llmgw config init` writes. Its values are the defaults of
llmgw.config (a test parses it and compares with default_config()); its commented examples
parse too once uncommented."""

STARTER_TEXT = '''\
# llmgw configuration.
# Every key is optional; the values shown are the defaults.

[server]
host = "127.0.0.1"               # listen address; "0.0.0.0" listens on all interfaces
port = 8000
api_keys = []                    # accepted bearer tokens; empty = no authentication
max_body_bytes = 8388608         # 8 MiB; larger request bodies are refused
request_id_header = "x-request-id"
max_connections = 0              # open connections at most; 0 = from the fd limit: (limit - 256) / 2
first_request_timeout_s = 10.0   # a new connection that sends nothing this long is closed
shutdown_grace_s = 30.0          # SIGTERM: requests in flight may finish this long; 0 = cut at once

[admin]
# Unix socket of the admin API. Default: $XDG_RUNTIME_DIR/llmgw-<uid>/admin.sock,
# or /tmp/llmgw-<uid>/admin.sock when XDG_RUNTIME_DIR is unset.
# socket = "/run/llmgw/admin.sock"
# Optional TCP admin listener ("host:port"); it requires a token.
# tcp = "127.0.0.1:8001"
# token = "change-me"

[sim]
# The embedded simulated fleet started by the default one-process mode.
engine = "vllm"                  # "vllm" or "llamacpp"
replicas = 2
model = "sim-model"
extra_args = []                  # extra arguments passed to `llmgw sim`

[router]
scrape_interval_s = 1.0          # how often each replica's /metrics is read
stale_after_s = 5.0              # older scraped metrics are stale (live inflight counts still apply)
scrape_idle_factor = 4.0         # an idle replica (nothing moves) is read up to this many times less often
connect_timeout_s = 3.0
first_byte_timeout_s = 600.0     # long prefills can take minutes before the first byte
first_byte_fast_s = 30.0         # ...but while another replica is idle, a silent engine gets this
                                 # long (+1 s per 1,000 prompt tokens), then the request moves there
idle_timeout_s = 120.0           # longest silence between streamed chunks
max_attempts = 3                 # replicas tried for one request while nothing was sent to the client
kv_ceiling = 0.95                # replicas above this KV-cache usage get a hard penalty
saturation_load = 64.0           # running+waiting at which a replica counts as saturated
queue_size = 256                 # requests held when every replica is saturated
queue_timeout_s = 10.0           # then 429 with Retry-After
decisions_kept = 1000            # recent decisions kept with their rationale

[router.traces]                  # every request's trace: phases, attempts, retries
kept = 1000                      # recent traces kept in memory (llmgw ctl trace REQUEST_ID)
# file = "/var/log/llmgw/traces.jsonl"   # also append finished traces here, one JSON object a line
sample = 1.0                     # with a file: the share of traces written (0.1 = every 10th)
max_file_mb = 64.0               # the file is rotated at this size (file.1, file.2, ...)
files_kept = 3                   # rotated files kept

[router.breaker]
failure_threshold = 3            # consecutive failures that open the breaker; 1 = plain cooldown
cooldown_s = 5.0                 # first open period; doubles after each failed probe
max_cooldown_s = 120.0
half_open_probes = 1

[router.prefix]
guard = "spill"                  # "spill", "imbalance" or "none": how load overrides prefix affinity
abs_gap = 8.0                    # imbalance: a holder loses affinity when its load exceeds the least
rel_gap = 1.5                    #   loaded candidate's by abs_gap requests AND by a factor rel_gap
spill_factor = 1.5               # spill: ... when its load > spill_factor x mean + spill_slack
spill_slack = 4.0
budget_mb = 64.0                 # memory of the prefix index (LRU eviction of leaves beyond it)

# Pools group replicas; a lower priority is preferred.
# [[pools]]
# name = "default"
# priority = 0
# max_inflight_per_replica = 16  # optional
#
# [[pools]]
# name = "burst"
# priority = 10

# Strategies are only weights and a picker; the presets are chat, batch and long-context.
# A request may name one with the x-llmgw-strategy header.
# [[strategies]]
# name = "least-loaded"
# picker = "power-of-two"        # max-score, power-of-two, softmax (with temperature), round-robin
# weights = { load = 0.7, queue = 0.3 }

# Models served by static endpoints. Names must be unique.
# [[models]]
# name = "llama-3-8b"
# engine = "vllm"                # "vllm" or "llamacpp"
# strategy = "chat"              # "chat" (cache-aware), "batch", "long-context" or "load-balance"
# pools = ["default", "burst"]
# metrics = { kv_usage = "vllm:kv_cache_usage_perc" }   # optional metric name overrides
#
# [[models.replicas]]
# url = "http://10.0.0.5:8000"
# pool = "default"
# weight = 1.0
#
# [[models.replicas]]
# url = "http://10.0.0.6:8000"
# pool = "burst"

# Models whose replicas the agents run, placed by the router (see docs/architecture.md).
# [[models]]
# name = "qwen-7b"
# engine = "vllm"
# max_loaded_adapters = 4        # LoRA adapters a replica holds at once (vLLM --max-loras)
# max_lora_rank = 16             # vLLM --max-lora-rank: 1, 8, 16, 32, 64, 128, 256, 320 or 512
# [models.deploy]
# count = 2                      # replicas
# model_path = "Qwen/Qwen2.5-7B-Instruct"   # what `vllm serve` / `llama-server -m` gets; default: name
# simulate = false               # true: run `llmgw sim` instead of the real engine
# binary = "vllm"                # default: vllm / llama-server on PATH
# args = ["--max-model-len", "8192"]
# env = ["HF_HOME=/models/hf"]
# gpus = 1                       # GPUs per replica ...
# gpu_memory_mb = 20000          # ... with at least this much memory each
# memory_mb = 16000              # host memory per replica
# node_selector = { "llmgw.io/site" = "fra" }   # only nodes with these labels
# health_timeout_s = 600.0       # an engine not healthy by then is reported failed, with its log
# pool = "default"
# weight = 1.0
# kv_events = false             # vLLM only: publish KV cache events for tier-2 routing
# Facility-aware placement (docs/placement.md): unset spread = soft, max skew 1, over rooms,
# rows, racks and PDUs; a hard rule refuses a node past it (a replica may then stay unplaced).
# spread = [{ level = "rack", max_skew = 1, hard = true }, { level = "pdu", max_skew = 1 }]
# watts = 700                    # declared draw of one replica, for [facility.budgets] (0: from the GPU table)
# nodes = 1                      # nodes per replica, 1..64: one engine process on each (docs/placement.md)
# keep_within = "rack"           # a multi-node replica's nodes all in one domain of this level
# [models.autoscale]             # the count follows load (docs/autoscaling.md); the deploy count is then ignored
# min = 1                        # 0: scale to zero after idle_to_zero_s without a request
# max = 4
# metric = "concurrency"         # concurrency | queue (per replica) | kv_usage (0-1) | ttft_p90 (seconds)
# target = 4.0                   # concurrency: requests in flight or waiting per replica
# window_s = 60.0                # the stable window; panic_window_s = 6.0 sees a burst (panic_threshold = 2.0)
# up_delay_s = 0.0               # a higher count must be asked this long; down_delay_s = 120.0 a lower one
# idle_to_zero_s = 0.0           # with min = 0: seconds without a request before the last replica stops
# cold_start_wait_s = 120.0      # a request for a model at zero waits this long for a replica, then 503
# [[models.adapters]]            # a LoRA adapter, asked for by its own name in "model" (docs/lora.md)
# name = "qwen-7b-sql"
# source = "/models/lora/qwen-sql"   # a path on the engine's node; vLLM: or a repository id; llama.cpp: a .gguf
# static = false                 # vLLM: true = loaded at start, never unloaded; else loaded on demand
# scale = 1.0                    # llama.cpp: the scale a request for it applies (the others get 0)

[control]
# The router's side of the agent stream. New nodes join with the join token (and get a
# credential of their own); without one (and outside the one-process mode, which makes its
# own) no agent can join. `llmgw ctl join-info` prints what an agent needs.
# listen = "0.0.0.0:7070"        # to accept agents from other machines; default: 127.0.0.1:7070, and in
                                 # one-process mode (--role router,agent) an ephemeral loopback port
# join_token = "a long random secret"      # or join_token_file = "/etc/llmgw/join-token"
# tls = true                     # default: TLS unless listen is loopback; false = plain TCP (opt-out)
# tls_cert = "/etc/llmgw/router.pem"       # with tls_key: your certificate instead of the generated CA's
# tls_key = "/etc/llmgw/router.key"
# tls_dir = "/var/lib/llmgw/tls"           # the generated CA and certificate; default: "tls" beside the store
# engine_networks = ["10.1.0.0/16"]        # engines may listen here besides their node's own address
hello_timeout_s = 5.0            # a new connection must say hello within this
max_hello_bytes = 65536          # frame cap until a hello is accepted (then max_message_bytes)
max_pending_agents = 128         # connections waiting for their hello; more are closed at once
heartbeat_s = 1.0
not_ready_after_s = 5.0          # silence before a node is not ready (nothing new placed there)
lost_after_s = 30.0              # not ready this long = lost: its replicas are placed elsewhere
max_lost_fraction = 0.5          # more of a rack's nodes holding replicas silent = maybe our own network:
partition_lost_interval_s = 60.0 # ... then one of them is lost per this (docs/architecture.md, partition guard)
new_nodes_per_minute = 60        # new node names the join token may register a minute; more are refused (retry)
kv_events_per_s = 100000         # a node's KV event budget: block events a second (+1 a message); more are
kv_events_burst = 2000000        # ... dropped undecoded, beyond this much saved up (docs/prefix-routing.md)
settle_s = 3.0                   # after a start, agents get this long to join before anything is placed
drain_timeout_s = 30.0           # a replica being removed may finish its requests for this long
autoscale_interval_s = 1.0       # the leader decides each [models.autoscale] model's count this often
max_message_bytes = 4194304      # larger messages close the connection
# store = "/var/lib/llmgw/router.db"       # default: $XDG_STATE_HOME/llmgw/router.db

[store]
# Where the fleet's state is kept (docs/ha.md). Unset: the SQLite file at [control] store, for one
# router. Several routers share one PostgreSQL database (pip install 'llmgw[postgres]'): each of
# them serves, one leads the control plane.
# url = "postgresql://llmgw@db.example:5432/llmgw"  # or "sqlite:/var/lib/llmgw/router.db"
# password_file = "/etc/llmgw/pg-password"   # PostgreSQL's password, kept out of this file (0600)
timeout_s = 2.0                  # every store call at most; past it the router runs from memory
lease_s = 5.0                    # the leader's lease (renewed every lease_s / 3): a dead leader's successor
poll_s = 0.5                     # ... leads within it; followers check the store for changes this often

[agent]
# This node's agent (--role agent, or the local agent of the one-process mode).
# node = "gpu-01"                # default: the host name
router = "127.0.0.1:7070"        # the router's [control] listen address
# join_token = "a long random secret"      # or join_token_file = "...": needed to join the first time
# tls = true                     # default: TLS when a CA is given or the router is not on loopback
# tls_ca = "/etc/llmgw/router-ca.pem"      # the CA to trust (or tls_ca_pem = the PEM inline)
# tls_server_name = "llmgw-control"        # the name in the router's certificate; default: its host
labels = {}                      # e.g. { site = "fra", rack = "r12" } (= "llmgw.io/site", "llmgw.io/rack")
advertise_host = "127.0.0.1"     # engines listen here and the router dials it: the node's address
# state_dir = "/var/lib/llmgw/agent"       # default: $XDG_STATE_HOME/llmgw/agent
# gpus = [{ name = "L4", memory_mb = 24000 }]   # declared GPUs instead of nvidia-smi's
# memory_mb = 65536              # instead of /proc/meminfo
declared_watts = 0               # this node's power draw for [facility.budgets]; 0: GPU table / nvidia-smi
reconnect_min_s = 0.5            # reconnect backoff, jittered
reconnect_max_s = 30.0
stop_grace_s = 10.0              # TERM, this long, then KILL to the engine's process group

[agent.restart]
base_s = 1.0                     # first restart delay after a crash; doubles per crash
max_s = 60.0
crashloop_after = 5              # this many crashes within window_s = crash loop (needs an operator)
window_s = 300.0

[facility]
# Failure domains (the llmgw.io/site, room, row, rack and pdu labels), spread, holds and power
# budgets: docs/placement.md. Holds are set with `llmgw ctl facility hold DOMAIN` and kept in the store.
rebalance = true                 # move replicas when a model's spread is past its max skew (nodes joined)
rebalance_interval_s = 30.0      # at most one round of moves this often
rebalance_max_moves = 1          # replicas moved per round, fleet-wide (each surge first, then drain)

[facility.budgets]
# Watts a domain (LEVEL=VALUE, quoted) may draw: a replica that would take it past is not placed.
# "pdu=p7" = 11000
# "rack=r12" = 20000

[tenants]
# API keys by tenant, quotas, priority bands and usage accounting (docs/tenants.md). Tenants and
# keys are made with `llmgw ctl tenants` / `llmgw ctl keys` and kept in the store.
static_tenant = "static"         # the tenant the keys of [server] api_keys belong to
static_band = "normal"           # ... and its priority band
anonymous_tenant = "default"     # who requests are counted under when no key is needed (no key anywhere)
default_max_tokens = 1024        # tokens charged up front for a request naming no max_tokens (then settled)
stream_usage = true              # ask engines for a stream's usage (and strip it when the client did not)
usage_flush_s = 10.0             # this router's usage records to the store this often
share_sync_s = 2.0               # several routers: quota shares and budgets' spent tokens re-read
raw_retention_h = 48.0           # per-minute usage records kept this long (hourly roll-ups stay)
hourly_retention_days = 400.0    # hourly usage roll-ups kept this long

[ha]
# Several routers in front of one fleet (docs/ha.md).
feed_listen = "127.0.0.1:0"      # routing as one: where this router publishes its prefix-tree inserts
                                 # (0 = an ephemeral port); other routers subscribe to it
# feed_advertise = "10.0.0.1"    # what they dial: a host (the bound port is added) or host:port;
                                 # default: the bound address (required when feed_listen is 0.0.0.0)
'''
