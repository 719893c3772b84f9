"""lockserve.configs: the typed serving configuration and its YAML presets.

``load_config(path, overrides)`` returns a validated ``ServeConfig``; any problem
is a ``ConfigError`` naming the source, field path and value. ``serve.yaml``
(the defaults, embedded model) and ``serve-cpu.yaml`` ship with the package.
"""

from lockserve.configs.loader import (
    ConfigError,
    default_config_path,
    load_config,
    parse_override,
    readable_reason,
)
from lockserve.configs.schema import (
    ATTENTION_MODES,
    DEFAULT_MODEL_SOURCE,
    TIERS,
    CacheConfig,
    ModelConfig,
    RayConfig,
    SchedulerConfig,
    ServeConfig,
    ServerConfig,
)

__all__ = [
    "ATTENTION_MODES",
    "DEFAULT_MODEL_SOURCE",
    "TIERS",
    "CacheConfig",
    "ConfigError",
    "ModelConfig",
    "RayConfig",
    "SchedulerConfig",
    "ServeConfig",
    "ServerConfig",
    "default_config_path",
    "load_config",
    "parse_override",
    "readable_reason",
]
