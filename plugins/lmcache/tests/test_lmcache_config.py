"""lmcache: config validation through the whole pipeline (messages and locations), no torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from kvc_lmcache.config import LMCacheConfig, lmcache_field_names

from composer import discover, load_pipeline, validate_text
from composer.errors import PipelineInvalid


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
    from pathlib import Path

    return str(Path(__file__).resolve().parents[3])
