"""LoRA adapters in the server, with vLLM's conventions: ``serve --lora-modules NAME=PATH ...
--max-loras N --max-lora-rank R`` (``--enable-lora`` for adapters loaded later); a request's ``model``
field names an adapter (or the base model's served name); ``/v1/models`` lists the adapters with
their sha256; ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``POST
/v1/unload_lora_adapter`` ``{"lora_name"}``, behind the API key. A bad adapter gets 400 and changes
nothing; unloading one that requests use gets 409. Each response is bitwise that of its request
alone with its adapter (``invariant_infer.engine.lora_slots``)."""
from __future__ import annotations

from fastapi import APIRouter, Depends
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from ..errors import LoraAdapterError
from .errors import JSON, APIError
from .protocol import OpenAIRequest, Text
from .routes import authorized, server_state
from .state import ServerState


class LoadLoraAdapterRequest(OpenAIRequest):
    lora_name: Text = Field(min_length=1)
    lora_path: Text = Field(min_length=1)


class UnloadLoraAdapterRequest(OpenAIRequest):
    lora_name: Text = Field(min_length=1)


lora_api = APIRouter(dependencies=[Depends(authorized)])


def _serving_adapters(server: ServerState) -> None:
    if server.engine.core.loras is None:
        raise APIError(400, "this server serves no LoRA adapters: start it with --enable-lora (or --lora-modules)",
                       code="lora_not_enabled")


@lora_api.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraAdapterRequest, server: ServerState = Depends(server_state)):
    _serving_adapters(server)
    if body.lora_name == server.options.model_name:
        raise APIError(400, f"{body.lora_name!r} is the base model's name", param="lora_name", code="invalid_value")
    try:
        adapter = await run_in_threadpool(server.async_engine.locked,
                                          lambda engine: engine.add_lora(body.lora_name, body.lora_path))
    except LoraAdapterError as exc:
        raise APIError(400, f"{exc}; nothing was changed", param="lora_path", code="invalid_lora_adapter") from None
    return JSON({"success": True, "message": f"LoRA adapter {adapter.name!r} added (rank {adapter.rank})",
                 "lora_name": adapter.name, "rank": adapter.rank, "sha256": adapter.sha256})


@lora_api.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, server: ServerState = Depends(server_state)):
    _serving_adapters(server)

    def remove(engine) -> bool:  # under the engine's lock: the check and the removal see one state
        if body.lora_name not in {a.name for a in engine.list_loras()}:
            return False
        engine.remove_lora(body.lora_name)
        return True
    try:
        removed = await run_in_threadpool(server.async_engine.locked, remove)
    except LoraAdapterError as exc:
        raise APIError(409, str(exc), param="lora_name", code="lora_in_use") from None
    if not removed:
        raise APIError(404, f"no LoRA adapter named {body.lora_name!r} is loaded", param="lora_name",
                       code="lora_not_found")
    return JSON({"success": True, "message": f"LoRA adapter {body.lora_name!r} removed"})
