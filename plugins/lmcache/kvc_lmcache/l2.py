"""The L2 tiers of a started ``lmcache server``: typed ``--l2-adapter`` specs.

``server.l2`` is a list of storage backends under the server's L1 (CPU
memory). Each becomes one ``--l2-adapter JSON`` of LMCache's multiprocess
server. ``resp`` (Redis/Valkey through LMCache's C++ RESP client), ``valkey``
(LMCache's valkey-glide adapter: cluster mode, TLS, TTL) and ``fs`` (a
directory; survives restarts) have typed models here. Any other adapter
LMCache registers is accepted by name, its fields checked against the keys its
config class reads: both read from LMCache's source with :mod:`ast`, because
``import lmcache`` imports torch (:func:`kvc_lmcache.lmcache_internals.adapter_fields`).

Credentials never reach a command line: a password is read from the
environment variable named by ``password_env`` (or given as ``${VAR}``, which
the pipeline loader expands) and handed to the server in its environment
(``resp``: LMCache's own ``LMCACHE_RESP_PASSWORD``) or, for adapters that
have no such variable, in the JSON LMCache reads from its argv.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SecretStr,
    Tag,
    field_validator,
    model_validator,
)

from composer import Int, Number, did_you_mean, one_of
from kvc_lmcache.lmcache_internals import adapter_fields
from kvc_lmcache.sizes import GB, Bytes

Port = Annotated[int, Field(ge=1, le=65535)]
HOST_PORT = re.compile(r"^(?P<host>[^:\s,]+):(?P<port>\d{1,5})$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

#: Keys every adapter's JSON may carry (read by LMCache's base config parser).
COMMON_KEYS = frozenset(
    {"type", "affinity_tag", "shared", "eviction", "serde", "persist_enabled"}
)


class _Sealed(BaseModel):
    """Chunks sealed with AES-GCM on their way to L2 (LMCache's ``aesgcm`` serde)."""

    seal_key_file: str | None = Field(
        default=None,
        description=(
            "Absolute path of a secret key file (any length, e.g. 32 random bytes). Chunks are "
            "encrypted and authenticated with AES-GCM (LMCache's aesgcm serde) on their way to "
            "this tier: a corrupted, truncated or foreign chunk fails to load and is recomputed, "
            "and the store never holds plain KV. Every engine sharing the tier needs the same key."
        ),
    )

    @field_validator("seal_key_file")
    @classmethod
    def _absolute_key(cls, value: str | None) -> str | None:
        if value is not None and not Path(os.path.expanduser(value)).is_absolute():
            raise ValueError(f"expected an absolute path, got {value!r}")
        return None if value is None else os.path.expanduser(value)

    def _sealed(self, spec: dict[str, Any]) -> dict[str, Any]:
        if self.seal_key_file is not None:
            spec["serde"] = {"type": "aesgcm", "master_key_path": self.seal_key_file}
        return spec


class InlineSecretWarning(UserWarning):
    """A credential written in the pipeline file rather than taken from the environment."""


class _Credentials(_Sealed):
    """username/password, or the names of environment variables holding them."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    username: str | None = Field(default=None, description="Auth user (ACL); ${VAR} works.")
    password: SecretStr | None = Field(
        default=None,
        description="Auth password: write ${VAR} (expanded at load) or use password_env.",
    )
    username_env: str | None = Field(
        default=None, description="Name of an environment variable holding the user."
    )
    password_env: str | None = Field(
        default=None,
        description=(
            "Name of an environment variable holding the password, read when the server "
            "starts (kept out of the pipeline, its dumps and the server's argv)."
        ),
    )

    @field_validator("username_env", "password_env")
    @classmethod
    def _env_name(cls, value: str | None) -> str | None:
        if value is not None and not ENV_NAME.match(value):
            raise ValueError(f"expected an environment variable name, got {value!r}")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> _Credentials:
        if self.password is not None and self.password_env is not None:
            raise ValueError("password and password_env both given; use one")
        if self.username is not None and self.username_env is not None:
            raise ValueError("username and username_env both given; use one")
        if self.password is not None and not _from_environment(
            self.password.get_secret_value()
        ):
            # The loader expands ${VAR} before this model sees the value: a
            # password equal to no environment variable was written inline.
            warnings.warn(
                f"lmcache: an L2 {getattr(self, 'type', 'adapter')} password is written inline "
                "in the pipeline; use password: ${VAR} or password_env: VAR",
                InlineSecretWarning,
                stacklevel=2,
            )
        return self

    def resolved_username(self) -> str:
        if self.username_env is not None:
            return _env(self.username_env)
        return self.username or ""

    def resolved_password(self) -> str:
        if self.password_env is not None:
            return _env(self.password_env)
        return self.password.get_secret_value() if self.password is not None else ""


def _from_environment(value: str) -> bool:
    return any(v == value for v in os.environ.values())


def _env(name: str) -> str:
    try:
        return os.environ[name]
    except KeyError:
        raise L2ConfigError(f"environment variable {name} (an L2 credential) is not set") from None


class L2ConfigError(ValueError):
    """An L2 spec that cannot be turned into an adapter JSON (e.g. a missing secret)."""


class RespL2(_Credentials):
    """Redis/Valkey through LMCache's native C++ RESP client (standalone servers)."""

    type: Literal["resp"] = "resp"
    host: str = Field(default="127.0.0.1", min_length=1, description="Redis/Valkey host.")
    port: Port = Field(default=6379, description="Redis/Valkey port.")
    num_workers: Int = Field(default=8, ge=1, description="C++ I/O worker threads.")
    max_capacity_gb: GB = Field(
        default=0, ge=0, description="Capacity for LMCache's usage accounting; 0: none."
    )
    reconnect: bool = Field(
        default=True,
        description=(
            "Reconnect after the store restarts or a connection drops (KV Composer's wrapper "
            "of LMCache's RESP client, kvc_lmcache.resp_adapter); false: LMCache's own resp "
            "adapter, which needs an `lmcache server` restart after any store restart."
        ),
    )

    def adapter_json(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            "host": self.host,
            "port": self.port,
            "num_workers": self.num_workers,
        }
        if self.max_capacity_gb:
            params["max_capacity_gb"] = float(self.max_capacity_gb)
        if self.reconnect:
            return self._sealed(
                {
                    "type": "plugin",
                    "module_path": "kvc_lmcache.resp_adapter",
                    "class_name": "ReconnectingRespL2Adapter",
                    "adapter_params": params,
                }
            )
        return self._sealed({"type": "resp", **params})

    def adapter_env(self) -> dict[str, str]:
        # LMCache's RESP adapter reads these when its config leaves them empty:
        # the secret travels in the server's environment, not its argv.
        env = {}
        if user := self.resolved_username():
            env["LMCACHE_RESP_USERNAME"] = user
        if password := self.resolved_password():
            env["LMCACHE_RESP_PASSWORD"] = password
        return env

    def describe(self) -> str:
        return f"resp {self.host}:{self.port}"


class ValkeyL2(_Credentials):
    """Valkey through LMCache's valkey-glide adapter (needs ``valkey-glide-sync``)."""

    type: Literal["valkey"] = "valkey"
    startup_nodes: list[str] = Field(
        min_length=1, description="host:port seeds; standalone mode uses the first."
    )
    cluster_mode: bool = Field(default=False, description="Valkey/Redis Cluster.")
    tls_enable: bool = Field(default=False, description="TLS to the server.")
    key_prefix: str = Field(default="", description="Key namespace (no '@').")
    database_id: Int | None = Field(default=None, ge=0, description="Standalone DB number.")
    num_workers: Int = Field(default=8, ge=1, description="Worker threads (one client each).")
    request_timeout: Number = Field(default=5.0, gt=0, description="Seconds per request.")
    connection_timeout: Number = Field(default=10.0, gt=0, description="Seconds to connect.")
    ttl_seconds: Int | None = Field(default=None, ge=1, description="Per-key TTL; none: no expiry.")
    max_capacity_gb: GB = Field(default=0, ge=0, description="LMCache-driven eviction; 0: off.")

    @field_validator("startup_nodes")
    @classmethod
    def _nodes(cls, value: list[str]) -> list[str]:
        for node in value:
            match = HOST_PORT.match(node)
            if match is None or not 1 <= int(match["port"]) <= 65535:
                raise ValueError(f"expected host:port with a port 1-65535, got {node!r}")
        return value

    @field_validator("key_prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if "@" in value:
            raise ValueError("must not contain '@' (LMCache joins the prefix with '@')")
        return value

    def adapter_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": "valkey",
            "startup_nodes": ",".join(self.startup_nodes),
            "cluster_mode": self.cluster_mode,
            "tls_enable": self.tls_enable,
            "key_prefix": self.key_prefix,
            "num_workers": self.num_workers,
            "request_timeout": float(self.request_timeout),
            "connection_timeout": float(self.connection_timeout),
            "max_capacity_gb": float(self.max_capacity_gb),
        }
        if self.database_id is not None:
            out["database_id"] = self.database_id
        if self.ttl_seconds is not None:
            out["ttl_seconds"] = self.ttl_seconds
        # This adapter has no environment defaults: its credentials go in its JSON.
        if user := self.resolved_username():
            out["username"] = user
        if password := self.resolved_password():
            out["password"] = password
        return self._sealed(out)

    def adapter_env(self) -> dict[str, str]:
        return {}

    def describe(self) -> str:
        mode = "cluster" if self.cluster_mode else "standalone"
        return f"valkey {','.join(self.startup_nodes)} ({mode})"


class FsL2(_Sealed):
    """A directory of chunk files (local disk or a shared mount); survives restarts."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: Literal["fs"] = "fs"
    path: str = Field(min_length=1, description="Absolute directory for the chunk files.")
    relative_tmp_dir: str | None = Field(
        default=None, description="Sub-directory for files being written."
    )
    read_ahead_size: Bytes | None = Field(default=None, ge=1, description="Read-ahead bytes.")
    use_odirect: bool = Field(default=False, description="O_DIRECT reads and writes.")

    @field_validator("path")
    @classmethod
    def _absolute(cls, value: str) -> str:
        path = Path(os.path.expanduser(value))
        if not path.is_absolute():
            # Plugin configs are validated without the pipeline file's location,
            # and the server's working directory is the engine's: a relative
            # path would land wherever vLLM happened to be started.
            raise ValueError(
                f"expected an absolute path, got {value!r} (a relative one would depend on "
                "the engine's working directory)"
            )
        return str(path)

    @field_validator("relative_tmp_dir")
    @classmethod
    def _relative(cls, value: str | None) -> str | None:
        if value is not None and (Path(value).is_absolute() or ".." in Path(value).parts):
            raise ValueError("expected a relative sub-directory without '..'")
        return value

    def adapter_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "fs", "base_path": self.path}
        if self.relative_tmp_dir is not None:
            out["relative_tmp_dir"] = self.relative_tmp_dir
        if self.read_ahead_size is not None:
            out["read_ahead_size"] = self.read_ahead_size
        if self.use_odirect:
            out["use_odirect"] = True
        return self._sealed(out)

    def adapter_env(self) -> dict[str, str]:
        return {}

    def describe(self) -> str:
        return f"fs {self.path}"


class OtherL2(BaseModel):
    """Any other adapter LMCache registers, its fields passed through as given."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    type: str = Field(
        description="An LMCache L2 adapter type name.",
        # So that an editor's JSON Schema matches one model per entry (oneOf).
        json_schema_extra={"not": {"enum": ["resp", "valkey", "fs"]}},
    )

    @model_validator(mode="after")
    def _known(self) -> OtherL2:
        table = adapter_fields()
        if table is None:
            return self  # LMCache not installed: its server checks them when it starts
        if self.type not in table:
            raise ValueError(
                f'unknown L2 adapter "{self.type}"{did_you_mean(self.type, table)}; '
                f"LMCache has: {one_of(sorted(table))}"
            )
        allowed = table[self.type] | COMMON_KEYS
        for key in self.model_extra or {}:
            if key not in allowed:
                raise ValueError(
                    f'LMCache\'s "{self.type}" adapter has no field "{key}"'
                    f"{did_you_mean(key, allowed)}"
                )
        return self

    def adapter_json(self) -> dict[str, Any]:
        return {"type": self.type, **(self.model_extra or {})}

    def adapter_env(self) -> dict[str, str]:
        return {}

    def describe(self) -> str:
        return self.type


TYPED = ("resp", "valkey", "fs")  # the typed models; OtherL2's schema excludes them


def _which(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in TYPED else "other"


L2Adapter = Annotated[
    Annotated[RespL2, Tag("resp")]
    | Annotated[ValkeyL2, Tag("valkey")]
    | Annotated[FsL2, Tag("fs")]
    | Annotated[OtherL2, Tag("other")],
    Discriminator(_which),
]


def adapter_args(l2: list[Any]) -> tuple[list[str], dict[str, str]]:
    """``--l2-adapter JSON`` flags for ``lmcache server``, and the environment they need."""
    import json

    argv: list[str] = []
    env: dict[str, str] = {}
    for adapter in l2:
        argv += ["--l2-adapter", json.dumps(adapter.adapter_json(), sort_keys=True)]
        env.update(adapter.adapter_env())
    return argv, env
