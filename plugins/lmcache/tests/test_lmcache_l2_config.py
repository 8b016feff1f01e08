"""lmcache server.l2: typed L2 tiers, their errors, the --l2-adapter flags they become."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
from kvc_lmcache.config import LMCacheConfig
from kvc_lmcache.l2 import (
    FsL2,
    InlineSecretWarning,
    L2ConfigError,
    OtherL2,
    RespL2,
    ValkeyL2,
    adapter_args,
    adapter_fields,
)

from composer import PipelineInvalid, validate_text


def pipeline(l2: str) -> str:
    return textwrap.dedent("""\
        version: 1
        nodes:
          lm:
            plugin: lmcache
            config:
              server:
                l2:
        """) + textwrap.indent(textwrap.dedent(l2), " " * 10)


def errors(l2: str) -> str:
    with pytest.raises(PipelineInvalid) as err:
        validate_text(pipeline(l2), file="p.yaml")
    return str(err.value)


def server_l2(**l2: Any) -> list[Any]:
    return LMCacheConfig.model_validate({"server": {"l2": [l2]}}).server.l2


def test_each_typed_adapter_becomes_one_l2_adapter_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VK_PASS", "pw")
    l2 = LMCacheConfig.model_validate(
        {
            "server": {
                "l2": [
                    {"type": "resp", "host": "10.0.0.5", "port": 6380, "password_env": "VK_PASS"},
                    {"type": "resp", "port": 6381, "reconnect": False, "num_workers": 2},
                    {"type": "fs", "path": "/data/kv", "seal_key_file": "/etc/kv.key"},
                    {"type": "mock", "max_size_gb": 1, "mock_bandwidth_gb": 10},
                ]
            }
        }
    ).server.l2
    assert [type(a) for a in l2] == [RespL2, RespL2, FsL2, OtherL2]
    argv, env = adapter_args(l2)
    specs = [json.loads(argv[i + 1]) for i in range(0, len(argv), 2)]
    assert argv[::2] == ["--l2-adapter"] * 4
    assert specs[0] == {
        "type": "plugin",
        "module_path": "kvc_lmcache.resp_adapter",
        "class_name": "ReconnectingRespL2Adapter",
        "adapter_params": {"host": "10.0.0.5", "port": 6380, "num_workers": 8},
    }
    assert specs[1] == {"type": "resp", "host": "127.0.0.1", "port": 6381, "num_workers": 2}
    assert specs[2] == {
        "type": "fs",
        "base_path": "/data/kv",
        "serde": {"type": "aesgcm", "master_key_path": "/etc/kv.key"},
    }
    assert specs[3] == {"type": "mock", "max_size_gb": 1, "mock_bandwidth_gb": 10}
    # The secret travels in the server's environment, never in its argv.
    assert env == {"LMCACHE_RESP_PASSWORD": "pw"}
    assert "pw" not in " ".join(argv)


def test_a_missing_secret_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_SUCH_VAR", raising=False)
    (resp,) = server_l2(type="resp", password_env="NO_SUCH_VAR")
    with pytest.raises(L2ConfigError, match="NO_SUCH_VAR"):
        adapter_args([resp])


def test_valkey_adapter_credentials_and_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VK_USER", "u")
    (valkey,) = server_l2(
        type="valkey",
        startup_nodes=["a:7000", "b:7001"],
        cluster_mode=True,
        tls_enable=True,
        username_env="VK_USER",
        ttl_seconds=600,
    )
    assert isinstance(valkey, ValkeyL2)
    spec = valkey.adapter_json()
    assert spec["startup_nodes"] == "a:7000,b:7001" and spec["cluster_mode"] is True
    assert spec["tls_enable"] is True and spec["ttl_seconds"] == 600 and spec["username"] == "u"


def test_the_secret_is_hidden_in_dumps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VK_PASS", "hunter2")
    (resp,) = server_l2(type="resp", password="hunter2")
    assert "hunter2" not in repr(resp) and "hunter2" not in resp.model_dump_json()


def test_an_inline_password_is_warned_about(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VK_PASS", raising=False)
    with pytest.warns(InlineSecretWarning, match="password is written inline"):
        server_l2(type="resp", password="written-in-the-file")
    # From ${VAR} (the loader expands it before validation): no warning.
    monkeypatch.setenv("VK_PASS", "from-the-environment")
    with warnings.catch_warnings():
        warnings.simplefilter("error", InlineSecretWarning)
        server_l2(type="resp", password="from-the-environment")


def test_unknown_adapter_with_did_you_mean() -> None:
    text = errors("""\
        - type: redis
          host: x
        """)
    assert (
        'p.yaml:8:13: nodes.lm.config.server.l2[0].other: value error, unknown L2 adapter "redis"'
        in text
    )
    assert '(did you mean "resp"?)' in text


def test_port_out_of_range() -> None:
    text = errors("- {type: resp, port: 70000}\n")
    assert (
        "p.yaml:8:13: nodes.lm.config.server.l2[0].resp.port: "
        "input should be less than or equal to 65535"
    ) in text


def test_relative_fs_path_and_unknown_field() -> None:
    text = errors("""\
        - type: fs
          path: cache/dir
        - type: fs
          path: /abs
          base_path: /x
        """)
    assert "l2[0].fs.path: value error, expected an absolute path, got 'cache/dir'" in text
    assert 'l2[1].fs.base_path: unknown key "base_path"' in text


def test_other_adapters_fields_are_checked_against_lmcache() -> None:
    text = errors("""\
        - type: s3
          s3_endpoint: http://s3.local
          s3_regoin: eu
        """)
    assert 'LMCache\'s "s3" adapter has no field "s3_regoin" (did you mean "s3_region"?)' in text


def test_l2_needs_a_started_server() -> None:
    with pytest.raises(ValueError, match="l2: tiers of a server this node starts"):
        LMCacheConfig.model_validate(
            {"server": {"url": "tcp://127.0.0.1:5555", "l2": [{"type": "fs", "path": "/x"}]}}
        )


def test_adapter_table_is_read_without_importing_lmcache() -> None:
    code = (
        "import sys; from kvc_lmcache.l2 import adapter_fields as f; t = f();"
        "print(sorted(t['resp']), [m for m in ('torch', 'lmcache') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == (
        "['host', 'max_capacity_gb', 'num_workers', 'password', 'port', 'username'] []"
    )


def test_the_adapter_table_matches_lmcaches_registry() -> None:
    import importlib

    import lmcache  # noqa: F401  (installed by `make test`: missing must fail, not skip)
    from lmcache.v1.distributed.l2_adapters import config as l2config

    table = adapter_fields()
    assert table is not None
    folder = Path(l2config.__file__).parent
    for file in folder.glob("*_l2_adapter.py"):
        try:
            importlib.import_module(f"lmcache.v1.distributed.l2_adapters.{file.stem}")
        except ImportError:
            continue  # an optional dependency; its name is still in the source table
    registered = set(l2config.get_registered_l2_adapter_types())
    assert registered <= set(table), registered - set(table)
    for name in ("resp", "valkey", "fs"):
        assert name in registered


def test_kvc_plugins_and_the_schema_list_the_adapters() -> None:
    schema = json.dumps(LMCacheConfig.model_json_schema())
    for name in ("RespL2", "ValkeyL2", "FsL2", "OtherL2", "seal_key_file", "password_env"):
        assert name in schema


def test_l2_gauges_from_the_servers_prometheus_text() -> None:
    from kvc_lmcache.l2_stats import parse

    text = textwrap.dedent("""\
        # HELP lmcache_mp_l2_store_submitted_objects_chunks_total chunks submitted
        lmcache_mp_l2_store_submitted_objects_chunks_total 18.0
        lmcache_mp_l2_store_completed_objects_chunks_total 9.0
        lmcache_mp_l2_prefetch_failure_chunks_total{reason="not_found",model_name="m"} 2.0
        lmcache_mp_l2_prefetch_failure_chunks_total{reason="l1_oom",model_name="m"} 1.0
        lmcache_mp_l2_prefetch_load_completed_chunks_total 6.0
        lmcache_mp_lookup_hit_l2_tokens_total{cache_salt="",model_name="m"} 288.0
        lmcache_mp_l2_store_submitted_requests_total 3.0
        """)
    assert parse(text) == {
        "l2_store_chunks": 18,
        "l2_stored_chunks": 9,
        "l2_load_failed": 3,
        "l2_loaded_chunks": 6,
        "l2_hit_tokens": 288,
        "l2_failed": 12,
        "l2_errors": 0,
    }
    assert parse("")["l2_failed"] == 0


def test_adapter_errors_from_the_servers_status() -> None:
    from kvc_lmcache.l2_stats import adapter_errors

    status = {"storage_manager": {"l2_adapters": [{"type": "resp", "errors": 4}, {"type": "fs"}]}}
    assert adapter_errors(status) == 4
    assert adapter_errors({}) == 0


def test_kvc_graph_shows_the_tiers_l1_then_each_l2() -> None:
    example = str(Path(__file__).resolve().parents[3] / "examples" / "fleet-valkey.yaml")
    kvc = Path(sys.executable).with_name("kvc")
    text = subprocess.run(
        [str(kvc), "graph", example], capture_output=True, text=True, check=True
    ).stdout
    assert "tiers: L1: started lmcache server" in text
    assert " -> L2: resp 127.0.0.1:6379 -> L2: fs " in text
    data = json.loads(
        subprocess.run(
            [str(kvc), "graph", example, "--json"], capture_output=True, text=True, check=True
        ).stdout
    )
    tiers = {n["id"]: n["tiers"] for n in data["nodes"]}
    assert tiers["cpu"] == [] and [t.split(":")[0] for t in tiers["lmcache"]] == ["L1", "L2", "L2"]
