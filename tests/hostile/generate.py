"""The hostile pipeline corpus: every file ``kvc validate`` must reject quickly.

Each file is an attack or a malformed input that once crashed, hung, exhausted
memory, printed a traceback or forged output, or a variant an attacker would
try next. ``tests/test_hostile.py`` checks that the files in this folder are
exactly what :func:`corpus` produces, and runs each through the CLI under a
time and memory limit. Regenerate after editing: ``python tests/hostile/generate.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: A valid pipeline head; cases append or substitute to make it hostile.
NODE = """\
version: 1
nodes:
  disk:
    plugin: vllm
    config:
      connector: ExampleConnector
"""
#: A line that makes any pipeline above it invalid, for cases that might otherwise pass.
BAD_PORT = "      kv_port: x\n"


def _bomb(fan: int, levels: int, key: str = "lol", where: str = "") -> str:
    """A "billion laughs": each level lists the previous one ``fan`` times."""
    lines = [f"{where}a0: &a0 [{', '.join(['lol'] * fan)}]"]
    for i in range(1, levels + 1):
        refs = ", ".join([f"*a{i - 1}"] * fan)
        lines.append(f"{where}a{i}: &a{i} [{refs}]")
    lines.append(f"{where}{key}: *a{levels}")
    return "\n".join(lines) + "\n"


def _aliases() -> dict[str, str]:
    out: dict[str, str] = {}
    out["laughs-root"] = _bomb(10, 9)
    out["laughs-version"] = _bomb(10, 9, key="version")
    out["laughs-nodes"] = _bomb(10, 9, key="nodes")
    out["laughs-fan2"] = _bomb(2, 40)
    out["laughs-fan3"] = _bomb(3, 25)
    out["laughs-fan100"] = _bomb(100, 4)
    out["laughs-extra-config"] = (
        "x-defs:\n" + _bomb(10, 9, where="  ") + NODE + "      extra_config: {x: *a9}\n"
    )
    out["laughs-in-list"] = _bomb(10, 8) + "list: [*a8, *a8, *a8, *a8, *a8, *a8, *a8, *a8, *a8]\n"
    maps = "m0: &m0 {a: 1, b: 2, c: 3, d: 4, e: 5, f: 6, g: 7, h: 8, i: 9, j: 0}\n"
    for i in range(1, 9):
        maps += f"m{i}: &m{i} {{{', '.join(f'k{j}: *m{i - 1}' for j in range(10))}}}\n"
    out["laughs-maps"] = maps
    out["laughs-as-keys"] = _bomb(10, 9, key="k") + "keys: {? *a9 : 1}\n"
    out["laughs-block"] = (
        "a0: &a0\n"
        + "".join(f"  - lol{j}\n" for j in range(10))
        + "".join(
            f"a{i}: &a{i}\n" + "".join(f"  - *a{i - 1}\n" for _ in range(10)) for i in range(1, 9)
        )
        + "nodes: *a8\n"
    )
    merge = "b0: &b0 {k0: 1}\n"
    for i in range(1, 60):
        merge += f"b{i}: &b{i}\n  <<: [*b{i - 1}, *b{i - 1}]\n  k{i}: {i}\n"
    out["merge-doubling"] = merge
    out["merge-doubling-flow"] = "c0: &c0 {x: 1}\n" + "".join(
        f"c{i}: &c{i} {{<<: [*c{i - 1}, *c{i - 1}, *c{i - 1}], y{i}: 1}}\n" for i in range(1, 40)
    )
    out["merge-chain-long"] = "d0: &d0 {x: 1}\n" + "".join(
        f"d{i}: &d{i} {{<<: *d{i - 1}, y{i}: 1}}\n" for i in range(1, 600)
    )
    out["self-alias-seq"] = "version: &v [1, *v]\n"
    out["self-alias-map"] = "nodes: &n {disk: *n}\n"
    out["self-alias-deep"] = "a: &a {b: {c: {d: [*a]}}}\n"
    out["self-alias-merge"] = "a: &a {<<: *a}\n"
    out["undefined-alias"] = NODE + "      kv_port: *port\n"
    out["duplicate-anchor"] = "a: &x 1\nb: &x 2\n" + NODE
    out["alias-chain-long"] = "v0: &v0 1\n" + "".join(
        f"v{i}: &v{i} *v{i - 1}\n" for i in range(1, 2000)
    )
    out["alias-as-merge-scalar"] = "s: &s 1\nm: {<<: *s}\n" + NODE
    out["merge-non-mapping-list"] = "m: {<<: [1, [2], x]}\n" + NODE
    out["alias-of-scalar-many"] = (
        "x: &x " + "y" * 2000 + "\nlist: [" + ", ".join(["*x"] * 10000) + "]\n"
    )
    return out


def _depth() -> dict[str, str]:
    out: dict[str, str] = {}
    out["flow-seq-30k"] = "a: " + "[" * 30000 + "]" * 30000 + "\n"
    out["flow-seq-unclosed-30k"] = "a: " + "[" * 30000 + "\n"
    out["flow-map-20k"] = "a: " + "{a: " * 12000 + "1" + "}" * 12000 + "\n"
    out["flow-mixed-20k"] = "a: " + "[{a: " * 8000 + "1" + "}]" * 8000 + "\n"
    out["block-map-150"] = "".join(" " * i + f"k{i}:\n" for i in range(150)) + " " * 150 + "x\n"
    out["block-seq-150"] = "".join(" " * (2 * i) + "-\n" for i in range(150)) + " " * 300 + "x\n"
    out["block-seq-compact-300"] = "a:\n" + "- " * 300 + "x\n"
    out["depth-101"] = "a: " + "[" * 100 + "]" * 100 + "\n"
    out["deep-in-config"] = NODE + "      extra_config: " + "[" * 5000 + "]" * 5000 + "\n"
    out["deep-in-key"] = "? " + "[" * 5000 + "]" * 5000 + "\n: 1\n"
    out["deep-in-env-default"] = (
        NODE + "      engine_id: ${E_HOSTILE_UNSET:-" + "[" * 3000 + "}\n" + BAD_PORT
    )
    out["deep-unquoted-env"] = "version: ${DEEP_VALUE_NOT_SET:-" + "[" * 5000 + "}\nnodes: 1\n"
    return out


def _tags() -> dict[str, str]:
    bad = {
        "int-abc": "!!int abc",
        "float-abc": "!!float abc",
        "bool-maybe": "!!bool maybe",
        "int-0xZZ": "!!int 0xZZ",
        "int-empty": "!!int ''",
        "float-empty": "!!float ''",
        "int-0b2": "!!int 0b2",
        "int-0o9": "!!int 0o9",
        "int-sexagesimal": "!!int 1:2:x",
        "float-sexagesimal": "!!float 1:x",
        "int-dash": "!!int -",
        "int-underscores": "!!int _",
        "bool-empty": "!!bool ''",
        "binary-bad": "!!binary '%%%'",
        "binary": "!!binary aGk=",
        "timestamp-bad": "!!timestamp 2024-13-45",
        "timestamp": "!!timestamp 2024-01-01",
        "set": "!!set {a, b}",
        "omap": "!!omap [a: 1]",
        "pairs": "!!pairs [a: 1]",
        "python-object": "!!python/object/apply:os.system [echo pwned]",
        "python-name": "!!python/name:os.system",
        "custom-tag": "!mytag x",
        "verbatim-tag": "!<tag:evil.example,2024:x> y",
        "map-on-scalar": "!!map x",
        "seq-on-scalar": "!!seq x",
        "str-on-seq": "!!str [a]",
        "int-on-map": "!!int {a: 1}",
        "null-on-map": "!!null {a: 1}",
        "float-on-seq": "!!float [1.0]",
    }
    out: dict[str, str] = {}
    for name, value in bad.items():
        out[f"{name}-config"] = NODE + f"      kv_port: {value}\n"
        out[f"{name}-version"] = NODE.replace("version: 1", f"version: {value}")
    out["tag-directive"] = "%TAG !e! tag:evil.example,2024:\n---\nversion: !e!x 1\nnodes: {}\n"
    out["tag-on-key"] = NODE + "      !!int abc: 1\n"
    out["tag-on-merge-key"] = NODE + "      !!merge x: 1\n"
    out["bool-maybe-key"] = "!!bool maybe: 1\n" + NODE
    out["int-key-huge"] = "? !!int " + "9" * 5000 + "\n: 1\n" + NODE
    return out


def _numbers() -> dict[str, str]:
    big = "9" * 5000
    out: dict[str, str] = {}
    out["int-5000-version"] = NODE.replace("version: 1", f"version: {big}")
    out["int-5000-port"] = NODE + f"      kv_port: {big}\n"
    out["int-5000-negative"] = NODE + f"      kv_port: -{big}\n"
    out["int-5000-extra"] = NODE + f"      extra_config: {{n: {big}}}\n"
    out["int-5000-list"] = NODE + f"      extra_config: {{n: [{big}, {big}]}}\n"
    out["int-5000-key"] = NODE + f"      {big}: 1\n"
    out["int-5000-underscored"] = NODE + "      kv_port: " + "_".join(["999"] * 2000) + "\n"
    out["hex-5000"] = NODE + "      kv_port: 0x" + "f" * 5000 + "\n"
    out["octal-5000"] = NODE + "      kv_port: 0o" + "7" * 5000 + "\n"
    out["float-5000"] = NODE + f"      kv_port: {big}.5\n"
    out["float-exp-huge"] = NODE + "      kv_port: 1e400\n"
    out["float-exp-long"] = NODE + "      kv_port: 1e" + "9" * 5000 + "\n"
    out["int-5000-quoted-env"] = NODE + "      kv_port: ${BIG_NOT_SET:-" + big + "}\n"
    out["capacity-5000"] = (
        "version: 1\nnodes:\n  cpu:\n    plugin: offload-cpu\n    config: {capacity: " + big + "}\n"
    )
    out["min-blocks-5000"] = out["capacity-5000"].replace("capacity", "min_blocks")
    return out


def _encoding() -> dict[str, bytes]:
    head = NODE.encode()
    out: dict[str, bytes] = {}
    out["latin1-comment"] = b"version: 1 # caf\xe9\n" + head[11:]
    out["latin1-value"] = head + b"      engine_id: caf\xe9\n"
    out["latin1-key"] = head + b"      caf\xe9: 1\n"
    out["latin1-line1"] = b"\xe9" + head
    out["truncated-multibyte"] = head + b"      engine_id: \xe4\xb8\n"
    out["overlong-slash"] = head + b"      engine_id: \xc0\xaf\n"
    out["encoded-surrogate"] = head + b"      engine_id: \xed\xa0\x80\n"
    out["utf16-le-bom"] = "\ufeff".encode("utf-16-le") + NODE.encode("utf-16-le")
    out["utf16-be-bom"] = "\ufeff".encode("utf-16-be") + NODE.encode("utf-16-be")
    out["utf32"] = NODE.encode("utf-32")
    out["nul-byte"] = head + b"      engine_id: a\x00b\n"
    out["nul-only"] = b"\x00" * 64
    out["bel-in-plain"] = head + b"      engine_id: a\x07b\n"
    out["esc-in-plain"] = head + b"      engine_id: \x1b[31mred\n"
    out["c1-in-plain"] = head + "      engine_id: a\x85\x9bb\n".encode()
    out["bom-mid-file"] = head + "      engine_id: a\ufeffb\n".encode() + b"      kv_port: x\n"
    out["ff-bytes"] = b"\xff\xfe\xfd" * 100
    out["random-binary"] = bytes(range(256)) * 4
    out["cr-only-lines"] = NODE.replace("\n", "\r").encode() + b"      kv_port: x\r"
    out["del-char"] = head + b"      engine_id: a\x7fb\n"
    return out


def _env() -> dict[str, str]:
    out: dict[str, str] = {}
    value = NODE + "      engine_id: "
    unset = "${HOSTILE_UNSET_A:-"
    # A lazy regular expression backtracked quadratically here (seconds of CPU).
    out["unclosed-default-60k"] = value + "${A:-" * 12000 + "\n" + BAD_PORT
    out["unclosed-default-long-name"] = value + unset * 2000 + "\n" + BAD_PORT
    out["unclosed-dollar-brace-20k"] = value + "${" * 10000 + "\n" + BAD_PORT
    out["nested-defaults-20k"] = value + unset * 2000 + "x" + "}" * 2000 + "\n" + BAD_PORT
    out["dollars-20k"] = value + "$$${" * 5000 + "\n" + BAD_PORT
    out["long-name-20k"] = NODE + "      engine_id: ${" + "A" * 20000 + "}\n"
    out["many-unset"] = NODE + "      engine_id: " + "${NOT_SET_HOSTILE}" * 1000 + "\n"
    out["unset-in-key-position"] = (
        NODE + "      extra_config: {${UNSET_HOSTILE}: 1, k: ${UNSET_HOSTILE}}\n"
    )
    out["default-braces"] = NODE + "      engine_id: ${UNSET_HOSTILE:-{{{{}\n      kv_port: x\n"
    out["long-default-20k"] = NODE + "      kv_port: ${UNSET_HOSTILE:-" + "9" * 20000 + "}\n"
    # Alone in an otherwise valid file: a "${" that begins no reference was once kept as text.
    broken = {
        "unclosed-alone": "abc${UNSET_HOSTILE:-x",
        "unclosed-long-alone": "${UNSET_HOSTILE:-" + "x" * 60_000,
        "dollar-brace-alone": "${",
        "empty-name": "${}",
        "digit-name": "${1X}",
        "shell-default": "${UNSET_HOSTILE-x}",
        "nested-default": "${UNSET_HOSTILE:-${OTHER_HOSTILE}}",
        "escaped-then-unclosed": "$$${UNSET_HOSTILE",
    }
    for name, text in broken.items():
        out[name] = NODE + f"      engine_id: {text}\n"
    # What a variable brings is text, never YAML: typed fields refuse these as text.
    for name, text in {
        "default-python-tag": "!!python/object/apply:os.system [echo pwned]",
        "default-flow-list": "[8000]",
        "default-alias": "*port",
        "default-exponent": "8e3",
    }.items():
        out[name] = NODE + f"      kv_port: ${{UNSET_HOSTILE:-{text}}}\n"
    return out


def _strict() -> dict[str, str]:
    cpu = "version: 1\nnodes:\n  cpu:\n    plugin: offload-cpu\n    config: {{{}}}\n"
    lm = "version: 1\nnodes:\n  lm:\n    plugin: lmcache\n    config: {{{}}}\n"
    port = NODE + "      kv_port: {}\n"
    out: dict[str, str] = {}
    for v in ("0", "true", "false", "-1", "0B", ".inf", "''", "0KiB", "-1GiB", "1e400", "null"):
        out[f"capacity-{v.strip('.').strip(chr(39)) or 'empty'}"] = cpu.format(f"capacity: {v}")
    for v in ("true", "0", "-3", ".inf"):
        out[f"min-blocks-{v.strip('.')}"] = cpu.format(f"min_blocks: {v}")
    for v in ("true", "false", "1.0", "'1'", "2", "0", "-1", ".inf", ".nan", "null", "[1]"):
        name = v.strip(".'[]") or "empty"
        out[f"version-{name}{'-list' if '[' in v else ''}{'-quoted' if chr(39) in v else ''}"] = (
            NODE.replace("version: 1", f"version: {v}")
        )
    for v in ("-1", "0", "65536", "99999999", "true", ".inf", "1e400", "-.inf", "8000.5"):
        out[f"kv-port-{v.strip('.')}"] = port.format(v)
    for field in ("l1_size_gb", "mq_timeout", "startup_timeout", "heartbeat_interval"):
        for v in (".inf", ".nan", "-.inf", "true"):
            out[f"lmcache-{field}-{v.strip('.').replace('.', '')}"] = lm.format(
                f"server: {{{field}: {v}}}"
            )
    for field in ("max_local_cpu_size", "max_local_disk_size"):
        for v in (".inf", ".nan", "true"):
            out[f"lmcache-{field}-{v.strip('.')}"] = lm.format(f"mode: in_process, {field}: {v}")
    # Sizes no machine holds (a typo, a unit gone wrong): refused before launch.
    sized = "version: 1\nnodes:\n  cpu:\n    plugin: offload-cpu\n    config:\n      capacity: {}\n"
    for name, v in {
        "2EiB": "2EiB",
        "1.5EiB": "1.5 EiB",
        "16M-TiB": "16000000 TiB",
        "23-nines": "9" * 23,
        "2p60-plus-1": str(2**60 + 1),
        "1e30-GiB": "1e30 GiB",
        "env-default-2EiB": "${UNSET_HOSTILE:-2EiB}",
    }.items():
        out[f"capacity-{name}"] = sized.format(v)
    # JSON has no infinity or NaN: where no type refuses them they would become null.
    for v in (".nan", ".inf", "-.inf"):
        out[f"extra-config-{v.strip('.').replace('.', '')}"] = (
            NODE + f"      extra_config: {{x: [{v}]}}\n"
        )
    out["lmcache-chunk-size-true"] = lm.format("chunk_size: true")
    out["lmcache-blend-thresholds-nan"] = lm.format("mode: in_process, blend_thresholds: [.nan]")
    out["lmcache-blend-layers-bool"] = lm.format("mode: in_process, blend_check_layers: [true]")
    return out


def _forgery() -> dict[str, str]:
    fake = "file.yaml:1:1: <root>: all good"
    payloads = {
        "newline": f"x\\n{fake}",
        "cr": f"x\\r{fake}",
        "ansi-clear": "x\\e[2J\\e[H",
        "ansi-color": "\\e[32mok\\e[0m",
        "rtl-override": "abc\\u202Elmay.txt",
        "bidi-isolate": "a\\u2066b\\u2069",
        "zero-width": "a\\u200Bb",
        "line-separator": f"x\\u2028{fake}",
        "paragraph-separator": f"x\\u2029{fake}",
        "bell": "x\\a\\a",
        "backspace": "ok\\b\\b\\bno",
        "nel": f"x\\N{fake}",
        "tag-chars": "a\\U000E0041\\U000E0042",
        "osc-title": "\\e]0;pwned\\a",
    }
    out: dict[str, str] = {}
    for name, p in payloads.items():
        out[f"plugin-{name}"] = f'version: 1\nnodes:\n  n:\n    plugin: "{p}"\n'
        out[f"key-{name}"] = NODE + f'    "{p}": 1\n'
        out[f"connector-{name}"] = (
            NODE.replace("connector: ExampleConnector", f'connector: "{p}"') + "      kv_port: x\n"
        )
    out["node-id-newline"] = f'version: 1\nnodes:\n  "n\\n{fake}":\n    plugin: vllm\n'
    out["load-order-ansi"] = NODE + 'load_order: ["\\e[31mdisk"]\n'
    out["load-policy-rtl"] = NODE + 'load_policy: "first\\u202Ehit"\n'
    out["needs-newline"] = NODE + f'    needs: ["x\\n{fake}"]\n'
    out["role-newline"] = NODE + f'    role: "load\\n{fake}"\n'
    out["engine-id-surrogate-escape"] = NODE + '      kv_port: "\\uD800"\n'
    return out


def _graph() -> dict[str, str]:
    out: dict[str, str] = {}

    def nodes(count: int, needs: str) -> str:
        text = "version: 1\nnodes:\n"
        for i in range(count):
            need = needs.format(i=i, next=(i + 1) % count)
            text += f"  n{i}: {{plugin: vllm, config: {{connector: X}}, needs: [{need}]}}\n"
        return text

    chain = nodes(1000, "n{next}").replace("needs: [n0]}", "needs: [missing]}")
    out["needs-chain-1000"] = chain
    out["needs-cycle-1000"] = nodes(1000, "n{next}")
    out["needs-missing-1000"] = nodes(1000, "gone{i}")
    out["needs-chain-1000-typo"] = nodes(1000, "n{next}").replace("needs: [n0]}", "needs: [n]}")
    out["load-order-dupes"] = NODE + "load_order: [" + ", ".join(["disk"] * 3000) + "]\n"
    out["save-to-missing"] = NODE + "save_to: [" + ", ".join(f"x{i}" for i in range(2000)) + "]\n"
    out["many-unknown-keys"] = NODE + "".join(f"    bad{i}: 1\n" for i in range(2000))
    out["many-duplicate-keys"] = NODE + "".join("      kv_port: 1\n" for _ in range(2000))
    return out


def _yaml() -> dict[str, str]:
    out: dict[str, str] = {}
    out["empty"] = ""
    out["only-comment"] = "# nothing\n"
    out["only-document-marker"] = "---\n"
    out["only-end-marker"] = "...\n"
    out["null-root"] = "~\n"
    out["scalar-root"] = "hello\n"
    out["list-root"] = "- version: 1\n"
    out["tabs"] = NODE + "\tkv_port: 1\n"
    out["unclosed-quote"] = NODE + '      engine_id: "abc\n'
    out["unclosed-flow"] = NODE + "      extra_config: {a: [1, 2\n"
    out["bad-indent"] = NODE + "   kv_port: 1\n"
    out["two-documents"] = NODE + "---\n" + NODE
    out["yaml-directive-2"] = "%YAML 2.0\n---\n" + NODE
    out["yaml-directive-twice"] = "%YAML 1.1\n%YAML 1.1\n---\n" + NODE
    out["complex-key"] = "? [a, b]\n: 1\n" + NODE
    out["null-key"] = "~: 1\n" + NODE
    out["empty-key"] = ": 1\n" + NODE
    out["merge-scalar"] = NODE + "    <<: 1\n"
    out["merge-list-scalars"] = NODE + "    <<: [1, 2]\n"
    out["anchor-no-node"] = "a: &\n" + NODE
    out["bad-escape"] = NODE + '      engine_id: "\\q"\n'
    out["escape-past-unicode"] = NODE + '      engine_id: "\\U00110000"\n'
    out["long-line-60k"] = NODE + "      engine_id: " + "x" * 60_000 + "\n      kv_port: x\n"
    out["long-key"] = NODE + "    " + "k" * 60_000 + ": 1\n"
    out["many-documents"] = "---\na: 1\n" * 1000
    out["block-scalar-indicator"] = NODE + "      engine_id: |99\n        x\n"
    out["reserved-indicator"] = NODE + "      engine_id: @x\n"
    return out


def _shape() -> dict[str, str]:
    out: dict[str, str] = {}
    out["no-version"] = NODE.replace("version: 1\n", "")
    out["no-nodes"] = "version: 1\n"
    out["nodes-empty"] = "version: 1\nnodes: {}\n"
    out["nodes-list"] = "version: 1\nnodes: [a, b]\n"
    out["node-string"] = "version: 1\nnodes:\n  a: vllm\n"
    out["config-list"] = "version: 1\nnodes:\n  a:\n    plugin: vllm\n    config: [1]\n"
    out["needs-string"] = NODE + "    needs: disk\n"
    out["needs-self"] = NODE + "    needs: [disk]\n"
    out["all-disabled"] = NODE + "    enabled: false\n"
    out["unknown-plugin"] = "version: 1\nnodes:\n  a:\n    plugin: nope\n"
    out["plugin-not-string"] = "version: 1\nnodes:\n  a:\n    plugin: {x: 1}\n"
    out["node-id-bad"] = (
        "version: 1\nnodes:\n  '1 bad':\n    plugin: vllm\n    config: {connector: X}\n"
    )
    return out


def corpus() -> dict[str, bytes]:
    """File name -> contents, for every hostile file."""
    groups: dict[str, dict[str, str] | dict[str, bytes]] = {
        "alias": _aliases(),
        "depth": _depth(),
        "tag": _tags(),
        "number": _numbers(),
        "encoding": _encoding(),
        "env": _env(),
        "strict": _strict(),
        "forge": _forgery(),
        "graph": _graph(),
        "yaml": _yaml(),
        "shape": _shape(),
    }
    out: dict[str, bytes] = {}
    for group, cases in groups.items():
        for name, content in cases.items():
            data = content.encode() if isinstance(content, str) else content
            assert len(data) <= 100_000, name  # small enough to check in
            out[f"{group}-{name}.yaml"] = data
    return out


def write(folder: Path = HERE) -> None:
    for old in folder.glob("*.yaml"):
        old.unlink()
    for name, data in corpus().items():
        (folder / name).write_bytes(data)


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
