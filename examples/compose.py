"""Build examples/cpu-offload.yaml's pipeline in Python, validate it, print vLLM's config.

Run: python examples/compose.py
"""

from __future__ import annotations

import json
import sys

import composer


def build() -> composer.Pipeline:
    return composer.Pipeline(
        version=1,
        nodes={
            "cpu": composer.Node(
                plugin="offload-cpu",
                config={
                    "capacity": "4GiB",
                    "save": "prompt",
                    "min_blocks": 1,
                    "load_mode": "sync",
                    "checksums": False,
                },
            )
        },
    )


def main() -> int:
    try:
        # Same checks as `kvc validate`: plugin config, graph, roles, capabilities.
        pipeline = composer.load_pipeline(build())
    except composer.PipelineInvalid as exc:
        print(exc, file=sys.stderr)
        return 2
    print(json.dumps(composer.kv_transfer_config(pipeline), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
