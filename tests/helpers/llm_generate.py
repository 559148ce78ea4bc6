"""vLLM's own ``LLM.generate`` on token prompts, in a process of its own: the reference of regeneration.

    python llm_generate.py ARGS.json OUT.json

ARGS: model, prompts (token ids), engine (LLM keywords), sampling (SamplingParams keywords).
OUT: the generated token ids per prompt, in order.
"""

import json
import sys


def main() -> None:
    from vllm import LLM, SamplingParams  # noqa: PLC0415 - vLLM only in the process that runs it
    from vllm.inputs import TokensPrompt  # noqa: PLC0415 - the same

    args = json.loads(open(sys.argv[1]).read())
    llm = LLM(model=args["model"], enable_prefix_caching=False, **args["engine"])
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in args["prompts"]], SamplingParams(**args["sampling"]), use_tqdm=False
    )
    with open(sys.argv[2], "w") as fh:
        json.dump([list(o.outputs[0].token_ids) for o in outputs], fh)


if __name__ == "__main__":
    main()
