"""Per-request tier controls against a running ``kvc serve``: which nodes a request
loads from (``kv_load_tiers``) and saves to (``kv_store_tiers``), how many of
its tokens are saved (``max_offload_tokens``) and how long a tier keeps them
(``kv_retention``), in its ``kv_transfer_params``.

    python examples/tier_controls.py http://127.0.0.1:8000 MODEL [NODE]

Sends one prompt a few times, each with other controls, and prints the
prompt tokens vLLM did not compute (``cached_tokens``) and what KV Composer
said about the request (with ``annotate_outputs: true``: which nodes served it;
and any error in its controls).
"""

from __future__ import annotations

import json
import sys
import urllib.request
from typing import Any

PROMPT = "the cache block token layer model vllm connector offload memory " * 6


def complete(base_url: str, model: str, prompt: str, **controls: Any) -> dict[str, Any]:
    """One completion; ``controls`` go into its ``kv_transfer_params``."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    if controls:
        body["kv_transfer_params"] = controls
    request = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        result: dict[str, Any] = json.loads(response.read())
    return result


def main(argv: list[str]) -> int:
    if len(argv) not in (3, 4):
        print(__doc__, file=sys.stderr)
        return 2
    base_url, model = argv[1], argv[2]
    node = argv[3] if len(argv) == 4 else None
    runs: list[dict[str, Any]] = [
        {},  # saved by every saving node
        {},  # a hit, from whichever node load_policy picks
        {"kv_load_tiers": []},  # loads from no node: computed again
        {"kv_load_tiers": ["no-such-node"]},  # an error in the response, nothing loaded
        # Kept at least a minute after this request by the tiers that hold it.
        {"kv_retention": {"ttl_s": 60, "priority": 1}},
    ]
    if node:
        runs.append({"kv_load_tiers": [node]})
    for controls in runs:
        out = complete(base_url, model, PROMPT, **controls)
        cached = (out.get("usage", {}).get("prompt_tokens_details") or {}).get("cached_tokens")
        said = (out.get("kv_transfer_params") or {}).get("kv_composer")
        print(f"{json.dumps(controls)}: cached_tokens={cached} kv_composer={json.dumps(said)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
