"""How a batch's line runs: the request path of `/v1/completions`, taken later and in the name of the
batch's creator. This is the dispatcher's `Executor` (web/batch/dispatcher.py), used inside the app
context of the web process the dispatcher runs in.

- checked exactly as the same request sent alone (`check_completion`); a line with `stream: true` is
  refused, since its result is the whole completion;
- admitted against the creator's key (its current limits; a revoked key's lines get 401) and the
  line's `user`: the blocklist refuses it (403, in the error file), the rate limits make it wait
  (429: the line starts once they allow, and no abuse strike is recorded); the tokens reserved are
  settled with the real usage when the line ends;
- queued as the creator's job on the model's batch queue, which workers take from only when no
  interactive job waits; the job may wait there until the batch's window ends;
- its result is read as every job's is (`streaming.outcomes`); a line whose result nothing
  remembers any more runs again (it was never written to the batch's files, so it is still written once).
"""
from __future__ import annotations

import time

from web import access
from web.api.completions import check_completion
from web.api.models import served_models
from web.api.queue import job_queue
from web.api.streaming import outcomes
from web.batch.dispatcher import Outcome, Prepared
from web.batch.store import Batch, Inflight
from worker.protocol import APIError, bad_request

class BatchLines:
    def resolve_model(self, name: str) -> str | None:
        try:
            return served_models().get(name).id
        except APIError:
            return None

    def prepare(self, batch: Batch, body: dict, job_id: str) -> Prepared:
        if body.get("stream"):
            raise bad_request("stream is not supported in a batch: each line's result is its whole completion.",
                              "stream")
        checked = check_completion(body)
        job = checked.to_job().model_copy(update={"id": job_id})
        return Prepared(job_id, job, checked.reserved_tokens, checked.request.user)

    def admit(self, batch: Batch, prepared: Prepared) -> None:
        access.admit(_caller(batch), prepared.user, prepared.reserved, strike=False)

    def settle(self, batch: Batch, inflight: Inflight, used_tokens: int) -> None:
        try:
            caller = _caller(batch)
        except APIError:  # the key is gone, and its limits with it
            return
        access.settle(access.grant_for(caller, inflight.user, inflight.reserved), used_tokens)

    def enqueue(self, batch: Batch, prepared: Prepared) -> None:
        job_queue().enqueue(prepared.job, prepared.job.model, owner=batch.owner,
                            batch_window_left_s=batch.expires_at - time.time())

    def exists(self, job_id: str) -> bool:
        return job_queue().fetch(job_id) is not None

    def outcomes(self, job_ids: list[str]) -> dict[str, Outcome]:
        return outcomes(job_queue(), job_ids)

    def cancel(self, job_ids: list[str]) -> None:
        jq = job_queue()
        for job_id in job_ids:
            jq.cancel(job_id)


def _caller(batch: Batch) -> access.Caller:
    caller = access.caller_for(batch.caller.get("key_id"), batch.caller.get("address"))
    if caller is None:
        raise APIError(401, "The API key that created this batch has been revoked.", "invalid_request_error",
                       code="invalid_api_key")
    return caller
