"""Rollouts through vLLM servers (`ppo.rollout.engine=vllm`): token ids in, token ids and their sampled log-probs
out, the policy's weights pushed into every server before every rollout whose weights changed, and each push
verified.

- Generation: every dp rank sends its prompts (as token ids, one request per prompt with `n` samples and a seed
  derived from the run seed, the iteration, the rank and the prompt's position) to its server
  (`urls[dp_rank % len(urls)]`), all at once, so the server batches them (`submit`: they run while the trainer goes
  on; `collect` lays their answers out). Each choice names the weight version that sampled each of its tokens: a
  token from any other version than the one the request was sent under stops the run.
- Weight sync (a collective: every rank calls it): the actor's full weights (gathered from ZeRO-3 / FSDP2 shards,
  LoRA merged: the engine's `export_hf`) are written to a run-local or shared-memory folder (after this rank's
  requests in flight have their answers, on the weights they were sent under); rank 0 then pauses each
  server, has it reload the folder, resets its prefix cache (the cached KV of the old weights), names the new
  version, resumes it and reads the version back. Verification: a fixed probe sequence's log-probs from the
  server equal the trainer's within ppo.rollout.vllm.sync_tolerance (`sync_max_abs`), or every rank stops.
- Multi-turn rollouts (ppo.tools, stages/ppo/tools/multiturn.py): each turn sends every active trajectory's
  token ids (prompt and completion so far) as one request (n=1, max_tokens its budget, a seed per trajectory and
  turn), every token checked against the version held when the rollout began (`TurnDrawer`); with ppo.off_policy the
  whole loop runs in a background thread (`submit_work`), which a sync waits for like any request in flight.
- Colocated on the training GPUs (`sleep=true`): the server sleeps (frees its memory) while the trainer updates.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from llmtrain.data.prompts import PromptBatch
from llmtrain.distributed import barrier
from llmtrain.stages.ppo.engines.http import EngineError, call
from llmtrain.stages.ppo.engines.vllm_choices import check_versions, slim, tokens_and_logps
from llmtrain.stages.ppo.engines.vllm_server import ServerSettings, VLLMServer
from llmtrain.stages.ppo.rollout import Rollout, SamplingSettings, laid_out, padded_prompts

log = logging.getLogger(__name__)
PROBE_LENGTH = 24


@dataclass(frozen=True)
class VLLMSettings:
    urls: tuple[str, ...]  # servers the user runs; empty: start one from `server`
    server: ServerSettings | None
    run_dir: Path
    sleep: bool = False
    request_timeout_s: float = 600.0
    sync_tolerance: float = 1e-3
    sync_dir: str | None = None


@dataclass
class Requests:
    """One rank's generate requests for one prompt batch, in flight or answered."""
    url: str
    version: str | None  # the weight version the server held when they were sent: every token must come from it
    futures: list[Future]  # one per prompt: its n choices (the server's JSON); multi-turn: one, the trajectories

    def done(self) -> bool:
        return all(future.done() for future in self.futures)

    def answers(self) -> list[list[dict]]:
        return [future.result() for future in self.futures]

    @classmethod
    def answered(cls, url: str, version: str | None, answers: list[list[dict]]) -> Requests:
        """Requests whose answers are known already (restored from a checkpoint)."""
        futures = [Future() for _ in answers]
        for future, answer in zip(futures, answers):
            future.set_result(answer)
        return cls(url=url, version=version, futures=futures)


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _main_only(work):
    """`work()` on rank 0, its result on every rank; an EngineError there is raised on every rank (none is left
    waiting in a collective for a rank that stopped)."""
    result, error = None, None
    if _is_main():
        try:
            result = work()
        except EngineError as failure:
            error = str(failure)
    result, error = _from_main((result, error))
    if error is not None:
        raise EngineError(error)
    return result


def _from_main(value):
    """Rank 0's `value` on every rank (a Python object)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class VLLMEngine:
    def __init__(self, settings: VLLMSettings):
        self.settings = settings
        self.urls = list(settings.urls)
        self.server: VLLMServer | None = None
        self.weight_version: str | None = None  # what every server holds (None: not synced by this run yet)
        self.asleep = False  # colocated (sleep=true): the servers freed their memory after the last rollout
        self._in_flight: list[Requests] = []  # this rank's requests not yet known to be answered (submit)

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self, actor) -> None:
        """Connect (urls) or start a server on rank 0 with the policy's initial weights; every rank learns the URLs."""
        if not self.urls:
            folder = self._weights_folder("initial")
            actor.export_hf(folder)
            try:
                self.urls = [_main_only(lambda: self._start_server(folder))]
            finally:
                if _is_main():
                    _remove(folder)  # loaded at start; every sync names a folder of its own
        _main_only(lambda: [self._check_server(url) for url in self.urls])

    def _start_server(self, folder: Path) -> str:
        self.server = VLLMServer(self.settings.server, folder, self.settings.run_dir / "vllm_server.log",
                                 gpu=torch.cuda.is_available())
        return self.server.url

    def _check_server(self, url: str) -> None:
        models = call(url, "/v1/models", timeout_s=30).get("data", [])
        needed = self.settings.server.max_model_len if self.settings.server else None
        served = models[0].get("max_model_len") if models else None
        if needed and served and served < needed:
            raise EngineError(f"inference engine {url} serves max_model_len={served}, the run needs {needed} "
                              "(data.max_seq_len): restart it with --max-model-len >= that")

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    # ---- weights ---------------------------------------------------------------------------------
    def _weights_folder(self, name: str) -> Path:
        """Where a sync writes the weights: ppo.rollout.vllm.sync_dir, else /dev/shm when writable, else the run dir.
        The same path on every rank (rank 0's), since the engine reads what rank 0 writes."""
        base = self.settings.sync_dir
        if base is None:
            shm = Path("/dev/shm")
            base = str(shm) if shm.is_dir() and _writable(shm) else str(self.settings.run_dir)
        folder = None
        if _is_main():
            Path(base).mkdir(parents=True, exist_ok=True)
            folder = tempfile.mkdtemp(prefix=f"llmtrain-weights-{name}-", dir=base)
        return Path(_from_main(folder))

    def sync(self, actor, version: str) -> dict:
        """Push the actor's weights to every server as `version` and verify them (a collective: every rank calls it).
        Nothing to do when the servers already hold `version`."""
        if self.weight_version == version:
            return {}
        start = time.perf_counter()
        self.wait_in_flight()  # requests sent under the old weights finish on them (and are checked against them)
        folder = self._weights_folder(version)
        try:
            self._wake()
            actor.export_hf(folder)  # a collective: gathers the shards, merges LoRA; rank 0 writes
            barrier()
            _main_only(lambda: [self._reload(url, folder, version) for url in self.urls])
        finally:
            if _is_main():
                _remove(folder)
        written = time.perf_counter()
        max_abs = self.verify(actor, version)
        self.weight_version = version
        return {"sync_s": written - start, "sync_verify_s": time.perf_counter() - written, "sync_max_abs": max_abs}

    def wait_in_flight(self) -> None:
        """Until every request this rank sent has its answer (a failed one raises when it is collected)."""
        wait([future for requests in self._in_flight for future in requests.futures])
        self._in_flight = []

    def _reload(self, url: str, folder: Path, version: str) -> None:
        timeout = self.settings.request_timeout_s
        call(url, "/pause?mode=wait", {}, timeout_s=timeout)
        try:
            call(url, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}},
                 timeout_s=timeout)
        except EngineError as error:
            raise EngineError(f"{error}\ninference engine {url} could not load the policy's weights: it serves "
                              "another architecture or vocabulary; start it with the run's model") from error
        for _ in range(20):  # it answers success: false while requests still hold cached blocks
            if call(url, "/reset_prefix_cache", {}, timeout_s=timeout).get("success", True):
                break
            time.sleep(0.05)
        else:
            raise EngineError(f"inference engine {url}: /reset_prefix_cache kept answering success: false; the "
                              "old weights' cached KV could be reused")
        call(url, "/update_weight_version", {"new_version": version}, timeout_s=timeout)
        call(url, "/resume", {}, timeout_s=timeout)
        reported = call(url, "/weight_info", timeout_s=timeout).get("weight_version")
        if reported != version:
            raise EngineError(f"inference engine {url} reports weight version {reported!r} after the sync to "
                              f"{version!r}: its weights cannot be trusted")

    def verify(self, actor, version: str) -> float:
        """max |log p_engine − log p_trainer| over a fixed probe sequence, on every server; past the tolerance every
        rank raises (a collective: the trainer's forward runs on every rank)."""
        vocab = actor.model.config.get_text_config().vocab_size
        probe = [(7919 * i + 13) % vocab for i in range(1, PROBE_LENGTH + 1)]
        with torch.no_grad(), actor.generation_context() as model, actor.autocast():
            logits = model(input_ids=torch.tensor([probe], device=actor.ctx.device)).logits[0, :-1].float()
        trainer = torch.log_softmax(logits, -1).gather(1, torch.tensor(probe[1:], device=logits.device)[:, None])
        trainer = trainer.squeeze(1).cpu()  # (L - 1,)
        worst = _main_only(lambda: max(float((self._probe_logps(url, probe) - trainer).abs().max())
                                       for url in self.urls))
        if not worst <= self.settings.sync_tolerance:
            raise EngineError(f"weight sync to {version!r} not verified: the engine's log-probs of the probe sequence "
                              f"differ from the trainer's by up to {worst:.3g} (ppo.rollout.vllm.sync_tolerance="
                              f"{self.settings.sync_tolerance}); the engine would sample from other weights than the "
                              f"policy's (engines: {', '.join(self.urls)})")
        return worst

    def _probe_logps(self, url: str, probe: list[int]) -> torch.Tensor:
        answer = call(url, "/inference/v1/generate", {"token_ids": probe, "sampling_params": {
            "max_tokens": 1, "temperature": 1.0, "logprobs": 0, "prompt_logprobs": 0, "detokenize": False}},
            timeout_s=self.settings.request_timeout_s)
        rows = answer["prompt_logprobs"][1:]
        return torch.tensor([row[str(token)]["logprob"] for row, token in zip(rows, probe[1:])])

    def _each_server(self, path: str) -> None:
        _main_only(lambda: [call(url, path, {}, timeout_s=self.settings.request_timeout_s) for url in self.urls])

    # ---- generation ------------------------------------------------------------------------------
    def generate(self, actor, batch: PromptBatch, settings: SamplingSettings, *, pad_token_id: int,
                 eos_ids: list[int], seed: int, group=None) -> Rollout:
        """The rollout of this rank's prompts, sampled by its server: the hf engine's layout, with the engine's
        log-probs; every token must come from the version synced last (`check_versions`)."""
        return self.collect(actor, batch, self.submit(actor, batch, settings, eos_ids, seed), settings,
                            pad_token_id=pad_token_id, eos_ids=eos_ids, group=group)

    def submit(self, actor, batch: PromptBatch, settings: SamplingSettings, eos_ids: list[int], seed: int) -> Requests:
        """Send this rank's prompts to its server (one request per prompt, from a thread pool) and return at once:
        the requests run while the trainer goes on (ppo.off_policy, stages/ppo/async_rollout.py). Not a collective."""
        self._wake()
        url = self.urls[actor.dp_rank % len(self.urls)]
        prompts = [row[mask.bool()].tolist() for row, mask in zip(batch.input_ids.cpu(), batch.attention_mask.cpu())]
        pool = ThreadPoolExecutor(max_workers=max(1, min(len(prompts), 64)))
        futures = [pool.submit(self._request, url, prompt, settings, eos_ids, seed + i)
                   for i, prompt in enumerate(prompts)]
        pool.shutdown(wait=False)  # the submitted requests still run; the threads end with them
        requests = Requests(url=url, version=self.weight_version, futures=futures)
        self._in_flight = [r for r in self._in_flight if not r.done()] + [requests]
        return requests

    def collect(self, actor, batch: PromptBatch, requests: Requests, settings: SamplingSettings, *,
                pad_token_id: int, eos_ids: list[int], group=None) -> Rollout:
        """Wait for `requests` (sent for `batch`) and lay their samples out as a rollout (a collective: the widths
        agree over the dp ranks). Every token must come from the version the requests were sent under."""
        n, url = settings.n_samples_per_prompt, requests.url
        choices = [choice for answer in requests.answers() for choice in answer]  # a prompt's n samples consecutive
        if len(choices) != len(requests.futures) * n:
            raise EngineError(f"inference engine {url} returned {len(choices)} samples for {len(requests.futures)} "
                              f"prompts × n={n}")
        check_versions(url, choices, requests.version)
        ids, mask = padded_prompts(batch, n, pad_token_id, group)
        width = max([len(c["token_ids"]) for c in choices] + [1])
        responses = torch.full((len(choices), width), pad_token_id, dtype=torch.long)
        logps = torch.zeros((len(choices), width))
        for i, choice in enumerate(choices):
            tokens, values = tokens_and_logps(choice)
            responses[i, :len(tokens)], logps[i, :len(values)] = torch.tensor(tokens, dtype=torch.long), values
        device = ids.device
        # nothing to gather (gather_s 0): the requests' time is the rollout's, which the stage times
        return laid_out(ids, mask, responses.to(device), logps.to(device), batch, n, eos_ids, pad_token_id, group)

    def _request(self, url: str, prompt: list[int], settings: SamplingSettings, eos_ids: list[int],
                 seed: int) -> list[dict]:
        sampling = {"max_tokens": settings.max_new_tokens, "temperature": settings.temperature, "logprobs": 0,
                    "n": settings.n_samples_per_prompt, "seed": seed % (2 ** 31), "stop_token_ids": list(eos_ids),
                    "detokenize": False, "skip_special_tokens": False}
        if settings.temperature > 0:
            sampling.update(top_p=settings.top_p, top_k=settings.top_k if settings.top_k > 0 else -1)
        answer = call(url, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": sampling},
                      timeout_s=self.settings.request_timeout_s)
        return sorted(answer["choices"], key=lambda choice: choice["index"])

    @contextlib.contextmanager
    def turns(self, actor, settings: SamplingSettings, *, pad_token_id: int, eos_ids: list[int], seed: int, device):
        """Multi-turn: (a TurnDraw through this rank's server, no gather: 0 s), engines/__init__.py's protocol."""
        del pad_token_id, device
        yield self.turn_drawer(actor, settings, eos_ids, seed), 0.0

    def turn_drawer(self, actor, settings: SamplingSettings, eos_ids: list[int], seed: int) -> TurnDrawer:
        """A TurnDraw on this rank's server, bound to the version it holds now (every turn's tokens must be of it)."""
        self._wake()
        return TurnDrawer(self, self.urls[actor.dp_rank % len(self.urls)], self.weight_version, settings,
                          list(eos_ids), seed)

    def submit_work(self, drawer: TurnDrawer, work: Callable[[], list]) -> Requests:
        """Run `work()` (a rollout's whole multi-turn loop, drawing with `drawer`) in a background thread: its result
        the one answer of the Requests returned at once. Counted in flight: a sync first lets it finish on its weights.
        Not a collective."""
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="multi-turn-rollout")
        future = pool.submit(work)
        pool.shutdown(wait=False)
        requests = Requests(url=drawer.url, version=drawer.version, futures=[future])
        self._in_flight = [r for r in self._in_flight if not r.done()] + [requests]
        return requests

    @staticmethod
    def checkpointed(requests: Requests) -> list:
        """What a checkpoint keeps of answered requests (ppo.off_policy's rollouts in flight): what collect reads."""
        return [[slim(choice) for choice in answer] for answer in requests.answers()]

    def after_rollout(self) -> None:
        """Colocated: free the engine's memory for the update."""
        if self.settings.sleep and not self.asleep:
            self._each_server("/sleep?level=1")
            self.asleep = True

    def _wake(self) -> None:
        if self.asleep:
            self._each_server("/wake_up")
            self.asleep = False


@dataclass(frozen=True)
class TurnDrawer:
    """engines/__init__.py's TurnDraw on one server: each token list one request (n=1), all of a turn's at once."""
    engine: VLLMEngine
    url: str
    version: str | None  # every token of every turn must come from it
    settings: SamplingSettings
    eos_ids: list[int]
    seed: int  # the rollout's (the single-turn path's `seed`)

    def __call__(self, rows: list[list[int]], budgets: list[int], indices: list[int],
                 turn: int) -> list[tuple[list[int], list[float]]]:
        seeds = [turn_seed(self.seed, index, turn) for index in indices]
        with ThreadPoolExecutor(max_workers=max(1, min(len(rows), 64))) as pool:
            answers = list(pool.map(self._draw_one, rows, budgets, seeds))
        choices = [answer[0] for answer in answers]
        check_versions(self.url, choices, self.version)
        drawn = []
        for choice, budget in zip(choices, budgets):
            tokens, logps = tokens_and_logps(choice)
            drawn.append((tokens[:budget], logps[:budget].tolist()))
        return drawn

    def _draw_one(self, row: list[int], budget: int, seed: int) -> list[dict]:
        settings = replace(self.settings, max_new_tokens=budget, n_samples_per_prompt=1)
        return self.engine._request(self.url, row, settings, self.eos_ids, seed)


def turn_seed(seed: int, index: int, turn: int) -> int:
    """Trajectory `index`'s seed at `turn` (the single-turn path seeds prompt i with seed + i; one request per
    trajectory and turn here, each its own stream)."""
    return seed + index + 1_000_003 * turn


def _remove(folder: Path) -> None:
    """A weights folder, and the adapters a LoRA export writes beside it (models/lora.adapter_dir_for)."""
    from llmtrain.models.lora import adapter_dir_for

    for path in (folder, adapter_dir_for(folder)):
        shutil.rmtree(path, ignore_errors=True)


def _writable(path: Path) -> bool:
    try:
        with tempfile.NamedTemporaryFile(dir=path):
            return True
    except OSError:
        return False
