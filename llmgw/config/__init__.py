"""Typed llmgw configuration: one frozen-dataclass tree, read from TOML. This is its curated face:
import from ``llmgw.config``. Where each part lives: names (the routing names every part agrees
on), fields (``opt`` and the value checks), schema (the sections and the checks across them),
locate (a key's line in a TOML file), load (the errors, the walker, parse/load/dump), starter
(the text of `llmgw config init`); discovery (which file `llmgw daemon` and `ctl` read) and
defaults (the four defaults read from the machine, filled in by ``with_machine_defaults``) are the
shell's and are imported by their own names."""

from llmgw.config.fields import (
    header_name, host_port, http_url, in_range, key_value, known_strategy, label_keys, node_name, nonempty, one_of, opt,
    positive,
)
from llmgw.config.load import (
    ConfigError, ConfigProblem, default_config, dump_config, init_config_text, load_config, model_from_dict,
    model_to_dict, parse_config, render_key, to_plain, toml_document, too_deep_problem,
)
from llmgw.config.schema import (
    DEFAULT_POOL, ENGINES, AdapterConfig, AdminConfig, AgentConfig, BreakerConfig, Config, ControlConfig,
    DeployConfig, FacilityConfig, GpuConfig, LifecycleConfig, MetricNames, ModelConfig, PdConfig, PoolConfig,
    PrefixRoutingConfig, ROLES, ReplicaConfig, RoleGroupConfig, RestartConfig, RouterConfig, ScorerWeights, ServerConfig, SimConfig, SpreadConfig,
    StrategyConfig,
)

__all__ = [
    "DEFAULT_POOL", "ENGINES", "AdapterConfig", "AdminConfig", "AgentConfig", "BreakerConfig", "Config",
    "ConfigError", "ConfigProblem", "ControlConfig", "DeployConfig", "FacilityConfig", "GpuConfig", "LifecycleConfig", "MetricNames",
    "ModelConfig", "PdConfig", "PoolConfig", "PrefixRoutingConfig", "ROLES", "ReplicaConfig", "RoleGroupConfig", "RestartConfig", "RouterConfig",
    "ScorerWeights", "ServerConfig", "SimConfig", "SpreadConfig", "StrategyConfig",
    "default_config",
    "dump_config", "header_name", "host_port", "http_url", "in_range", "init_config_text", "key_value",
    "known_strategy", "label_keys", "load_config", "model_from_dict", "model_to_dict", "node_name", "nonempty",
    "one_of", "opt", "parse_config", "positive", "render_key", "to_plain", "toml_document", "too_deep_problem",
]
