"""lmcache: config validation through the whole pipeline (messages and locations), no torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kvc_lmcache.config import LMCacheConfig, lmcache_field_names
from kvc_lmcache.sizes import GIB, MAX_BYTES, MAX_GB
from pydantic import TypeAdapter, ValidationError

from composer import PipelineInvalid, PositiveByteSize, discover, load_pipeline, validate_text


def errors(yaml: str) -> str:
    with pytest.raises(PipelineInvalid) as err:
        validate_text(textwrap.dedent(yaml), file="p.yaml")
    return str(err.value)


def test_registered_through_the_entry_point() -> None:
    ptype = discover()["lmcache"]
    assert ptype.package == "kv-composer-lmcache"
    caps = ptype.resolve_capabilities(LMCacheConfig())
    assert caps.hma and caps.async_load and caps.async_save and not caps.needs_model


def test_lmcache_field_names_are_read_without_importing_lmcache() -> None:
    code = (
        "import sys; from kvc_lmcache.config import lmcache_field_names as f; n = f();"
        "print(len(n), 'chunk_size' in n, 'enable_xpyd' in n,"
        " [m for m in ('torch', 'lmcache', 'vllm') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    count, chunk, alias, imported = out.stdout.split(" ", 3)
    assert int(count) > 100 and chunk == "True" and alias == "True" and imported.strip() == "[]"


def test_the_names_match_lmcaches_own_config_class() -> None:
    # _CONFIG_*: LMCache's own private tables of its config keys and their aliases (it has no public
    # list of them): the truth that lmcache_field_names() is checked against.
    import lmcache  # noqa: F401  (installed by `make test`: missing must fail, not skip)
    from lmcache.v1.config import _CONFIG_ALIASES, _CONFIG_DEFINITIONS

    assert lmcache_field_names() == frozenset(_CONFIG_DEFINITIONS) | frozenset(_CONFIG_ALIASES)


def test_typo_in_an_lmcache_field() -> None:
    text = errors("""\
        version: 1
        nodes:
          lm:
            plugin: lmcache
            config:
              mode: in_process
              max_local_cpu_sise: 2
              extra: {min_retrive_tokens: 3}
        """)
    assert (
        'p.yaml:7:7: nodes.lm.config.max_local_cpu_sise: unknown key "max_local_cpu_sise" '
        '(did you mean "max_local_cpu_size"?)'
    ) in text
    assert (
        "p.yaml:8:14: nodes.lm.config.extra: value error, LMCache has no config field "
        '"min_retrive_tokens" (did you mean "min_retrieve_tokens"?)'
    ) in text


def test_blending_without_a_tracker() -> None:
    text = errors("""\
        version: 1
        nodes:
          tracker: {plugin: model-tracker}
          lm:
            plugin: lmcache
            config: {mode: in_process, enable_blending: true}
        """)
    assert (
        "p.yaml:5:5: nodes.lm.needs: needs the model but no dependency provides it "
        "(add needs: [tracker])" in text
    )


def test_blending_with_a_tracker_that_does_not_register_with_lmcache() -> None:
    text = errors("""\
        version: 1
        nodes:
          tracker: {plugin: model-tracker, config: {lmcache: never, lmcache_instance_id: x}}
          lm:
            plugin: lmcache
            needs: [tracker]
            config: {mode: in_process, enable_blending: true}
        """)
    assert (
        'p.yaml:6:13: nodes.lm.needs[0]: enable_blending: tracker "tracker" has lmcache: never'
        in text
    )
    assert 'registers the model as "x"' in text


def test_blending_with_a_tracker_is_valid() -> None:
    pipeline = validate_text(
        textwrap.dedent("""\
        version: 1
        nodes:
          tracker: {plugin: model-tracker}
          lm:
            plugin: lmcache
            needs: [tracker]
            config: {mode: in_process, enable_blending: true}
        """)
    )
    assert [n.id for n in pipeline.nodes] == ["tracker", "lm"]
    assert pipeline.node("lm").capabilities.needs_model


def test_in_process_options_in_server_mode() -> None:
    text = errors("""\
        version: 1
        nodes:
          lm: {plugin: lmcache, config: {local_disk: lmcache-disk, enable_blending: true}}
        """)
    assert "local_disk, enable_blending: in-process LMCache options, but mode is server" in text


def test_server_section_errors() -> None:
    text = errors("""\
        version: 1
        nodes:
          a: {plugin: lmcache, config: {server: {url: "http://h:1"}}}
          b: {plugin: lmcache, config: {server: {start: false}}}
          c: {plugin: lmcache, config: {server: {url: "tcp://h:1", start: true}}}
          d: {plugin: lmcache, config: {server: {extra_args: ["--port=1"], transfer_mode: x}}}
          e: {plugin: lmcache, config: {mode: in_process, server: {l1_size_gb: 2}}}
        """)
    assert "nodes.a.config.server.url: value error, expected tcp://host:port" in text
    assert "nodes.b.config.server: value error, no server: set url" in text
    assert "nodes.c.config.server: value error, url and start: true both given" in text
    assert "nodes.d.config.server.extra_args: value error, --port is set by the node" in text
    assert 'nodes.d.config.server.transfer_mode: "x" is not allowed' in text
    assert "server: options for mode server, but mode is in_process" in text


def test_hma_group_selection_needs_every_node_to_support_hma() -> None:
    text = errors("""\
        version: 1
        nodes:
          ex: {plugin: vllm, config: {connector: ExampleConnector}}
          lm: {plugin: lmcache, config: {mode: in_process, kv_cache_group: 1}}
        """)
    assert 'handles one KV cache group and needs HMA, but "ex" does not support' in text
    pipeline = load_pipeline(
        {
            "version": 1,
            "nodes": {
                "lm": {"plugin": "lmcache", "config": {"mode": "in_process", "kv_cache_group": 1}}
            },
        }
    )
    caps = pipeline.node("lm").capabilities
    assert caps.hma and caps.kv_cache_groups == "one"


def test_the_example_validates_without_heavy_imports() -> None:
    code = (
        "import sys; from composer import load_pipeline;"
        "p = load_pipeline('examples/tracker-offload-lmcache.yaml');"
        "print([n.id for n in p.nodes],"
        " [m for m in ('torch', 'lmcache', 'vllm') if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=_root()
    )
    assert out.stdout.strip() == "['tracker', 'cpu', 'lmcache'] []"


def _root() -> str:
    return str(Path(__file__).resolve().parents[3])


# -- sizes: at most 1 EiB, as the core bounds every size --------------------------- #

ABSURD = """\
version: 1
nodes:
  lm:
    plugin: lmcache
    config:
      server:
        l1_size_gb: 1e30
        l2:
          - {type: resp, max_capacity_gb: 2147483648}
          - {type: valkey, startup_nodes: ["v:6379"], max_capacity_gb: 1.5e+12}
          - {type: fs, path: /kv, read_ahead_size: 99999999999999999999999}
  in:
    plugin: lmcache
    config: {mode: in_process, max_local_cpu_size: 1.0e+30, max_local_disk_size: 1073741825}
"""
TOO_LARGE_GB = "expected a size of at most 1073741824 GB, which is 1 EiB: no machine holds more"


def test_sizes_no_machine_holds_are_refused_where_they_are_written() -> None:
    assert errors(ABSURD).splitlines() == [
        f'p.yaml:7:21: nodes.lm.config.server.l1_size_gb: {TOO_LARGE_GB} (got "1e30")',
        f"p.yaml:9:13: nodes.lm.config.server.l2[0].resp.max_capacity_gb: {TOO_LARGE_GB} "
        "(got 2147483648)",
        f"p.yaml:10:13: nodes.lm.config.server.l2[1].valkey.max_capacity_gb: {TOO_LARGE_GB} "
        "(got 1500000000000.0)",
        "p.yaml:11:13: nodes.lm.config.server.l2[2].fs.read_ahead_size: expected a size of at "
        "most 1152921504606846976 bytes, which is 1 EiB: no machine holds more "
        "(got 99999999999999999999999)",
        f"p.yaml:14:52: nodes.in.config.max_local_cpu_size: {TOO_LARGE_GB} (got 1e+30)",
        f"p.yaml:14:82: nodes.in.config.max_local_disk_size: {TOO_LARGE_GB} (got 1073741825)",
    ]


def test_one_eib_is_the_largest_size() -> None:
    config = LMCacheConfig.model_validate(
        {
            "server": {
                "l1_size_gb": 2**30,
                "l2": [{"type": "fs", "path": "/kv", "read_ahead_size": 2**60}],
            }
        }
    )
    assert config.server.l1_size_gb * 2**30 == MAX_BYTES
    assert config.server.l2[0].read_ahead_size == MAX_BYTES  # type: ignore[union-attr]
    with pytest.raises(ValidationError, match="at most 1073741824 GB"):
        LMCacheConfig.model_validate({"mode": "in_process", "max_local_cpu_size": 2**30 + 0.5})


def test_the_bound_is_the_cores() -> None:
    """The core's own size type takes 1 EiB and refuses a byte more."""
    assert MAX_GB * GIB == MAX_BYTES
    assert TypeAdapter(PositiveByteSize).validate_python(MAX_BYTES) == MAX_BYTES
    with pytest.raises(ValidationError, match="at most 1EiB"):
        TypeAdapter(PositiveByteSize).validate_python(MAX_BYTES + 1)


def test_kvc_validate_prints_the_absurd_sizes_and_exits_2(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(ABSURD)
    kvc = Path(sys.executable).parent / "kvc"
    run = subprocess.run(
        [str(kvc), "validate", "p.yaml"], capture_output=True, text=True, cwd=tmp_path
    )
    assert run.returncode == 2, run.stderr
    assert run.stdout.splitlines() == errors(ABSURD).splitlines()
    assert run.stderr == "6 problems in 1 file\n"
