"""Upstream 0.9.0's online protocol, answered by the service on vLLM 0.16 (MLA targets included).

Upstream's released data path (``speculators`` 0.9.0, ``hs-connectors`` 0.9.0)
asks a vLLM >= 0.22 server running ``extract_hidden_states`` with its
``ExampleHiddenStatesConnector`` for each sample's states. What its client does,
and what is answered here:

* ``GET /v1/models``: it takes ``data[0].id`` and requires it to equal the
  verifier name it was given: ours is ``--served-model-name`` (default: the
  ``--target-model-path`` as given).
* ``POST /v1/completions`` with ``prompt`` (token ids), ``max_tokens`` 1 and
  ``return_token_ids``: it requires ``choices[0].prompt_token_ids`` equal to what
  it sent and reads ``kv_transfer_params.hidden_states_path``. The file there is
  what vLLM's connector writes: safetensors ``hidden_states`` ``[T, layers,
  hidden]`` (the captured layers in ``--layer-ids`` order, the last one being
  what its dataset takes as the verifier's last state) and ``token_ids`` ``[T]``,
  in the engine's dtype. It is complete under its name before the answer (no
  ``.lock`` file is needed: upstream's reader waits on one only where it exists);
  upstream's ``FileTransfer`` deletes it once read, which the folder's cap sees.

Not served, said so with a 400: text prompts (send token ids), ``max_tokens`` > 1
(the service captures prefill), a client-chosen ``hidden_states_path``, and FP8
files (upstream's have one scale per token, ours one per token and layer). Its
consumers name no process, so only the lease (``--lease-seconds``) reclaims what
a dead one left. Layer ids: upstream 0.9.0 counts layer outputs from 1 (its id
``k`` is our ``k - 1``; its default ``[2, N//2, N-3, N]`` is ours
``--layer-ids 1 N//2-1 N-4 N-1``).
"""

from __future__ import annotations

import time

from speculators_v016.serve.service import CaptureService, RequestError


def models(service: CaptureService) -> dict:
    return {"object": "list", "data": [{"id": service.served_model_name, "object": "model", "owned_by": "speculators"}]}


def completion(service: CaptureService, body: dict) -> dict:
    """Serve one ``/v1/completions`` request of upstream's client; RequestError for what is not served."""
    if body.get("model") != service.served_model_name:
        raise RequestError(f"model {body.get('model')!r} is not served here: {service.served_model_name!r} is")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise RequestError("prompt must be token ids (one list of ints): this service does not tokenize text")
    if body.get("max_tokens", 1) != 1:
        raise RequestError(f"max_tokens {body.get('max_tokens')!r}: this service captures prefill only (max_tokens 1)")
    params = body.get("kv_transfer_params") or {}
    if isinstance(params, dict) and params.get("hidden_states_path"):
        raise RequestError("a client-chosen hidden_states_path is not served: files go to the service's --serve-dir")
    if service.backend.kind != "folder":
        raise RequestError(f"upstream's FileTransfer reads files: this service publishes to {service.backend.kind}")
    handle = service.submit(prompt, None, None, layout="stacked").result()
    path = str(service.backend.path_of(handle))
    return {
        "id": f"cmpl-{handle['file'].removesuffix('.safetensors')}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": service.served_model_name,
        "choices": [
            {
                "index": 0,
                "text": "",
                "logprobs": None,
                "finish_reason": "length",
                "prompt_token_ids": prompt,
                "token_ids": [],
            }
        ],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": 0, "total_tokens": len(prompt)},
        "kv_transfer_params": {"hidden_states_path": path},
    }
