"""vLLM's own loop on token prompts, in a process of its own: ``LLMEngine`` (add_request, then step until
done: what ``LLM.generate`` runs, without the ``LLM`` class and the server modules it imports).

    python vllm_loop.py ARGS.json OUT.json

ARGS: model, prompts (token ids), engine (EngineArgs keywords), sampling (SamplingParams keywords).
``stand_ins`` (optional, true): every torch stand-in of the GPU kit (:mod:`speculators_v016.testing.gpu_kit`:
fused MoE, MLA, activations, INT4 MoE) is registered first, and vLLM's engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that it sees them.
OUT: {"tokens": the generated token ids per prompt, in order, "seconds": the loop's time}.
"""

import json
import os
import sys
import time


def main() -> None:
    from vllm import SamplingParams  # noqa: PLC0415 - vLLM only in the process that runs it
    from vllm.engine.arg_utils import EngineArgs  # noqa: PLC0415 - the same
    from vllm.v1.engine.llm_engine import LLMEngine  # noqa: PLC0415 - the same

    args = json.loads(open(sys.argv[1]).read())
    if args.get("stand_ins"):
        from speculators_v016.testing import gpu_kit  # noqa: PLC0415 - the GPU kit's tests only

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        gpu_kit.install()
    engine = LLMEngine.from_engine_args(EngineArgs(model=args["model"], enable_prefix_caching=False, **args["engine"]))
    params = SamplingParams(**args["sampling"])
    start = time.perf_counter()
    for i, ids in enumerate(args["prompts"]):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[int(out.request_id)] = list(out.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    with open(sys.argv[2], "w") as fh:
        json.dump({"tokens": [tokens[i] for i in range(len(args["prompts"]))], "seconds": seconds}, fh)


if __name__ == "__main__":
    main()
