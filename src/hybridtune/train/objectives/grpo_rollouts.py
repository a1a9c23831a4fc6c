"""GRPO's data and rollouts: the run's prompts (`load_prompts`, `prepare_prompts`: one prompt a bin, so the trainer's
stream, epochs and resume walk prompts), and each step's window of packs of sampled, rewarded completions
(`Rollouts.window`: runtime/rollout.py samples the groups on the live weights, rewards.py scores them, grpo.py's
advantages, packing and collator make the packs; the objective's old and reference log-probs are taken once per
batch of completions, which serves `num_iterations` optimizer steps).

A row gives its prompt as `prompt` (text: continued as it is; a list of messages: rendered by the chat template with
the assistant's generation prompt), or as a chat (`messages`): the messages before the last assistant message, whose
content becomes the row's `answer` when it has none. Every other column goes to the reward functions (as TRL's
keywords: rewards.py). A prompt longer than max_prompt_length keeps its last tokens. A vision-language checkpoint
trains on text prompts (its vision tower idle and frozen); a row that carries images or videos is refused.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

from hybridtune.config import TrainConfig
from hybridtune.data.build import PreparedData
from hybridtune.data.chat import render
from hybridtune.data.formats import field_text, parse_messages
from hybridtune.data.packing import Example, PackStats
from hybridtune.data.rows import MEDIA_COLUMNS, MEDIA_PLACEHOLDERS, decode_json_cells
from hybridtune.data.sources import open_source
from hybridtune.errors import ConfigError, DataError, printable
from hybridtune.runtime.generation import eos_ids
from hybridtune.runtime.rollout import sample_groups
from hybridtune.runtime.stream import to_device
from hybridtune.train.objectives.grpo import Completion, CompletionCollator, group_advantages, pack_completions
from hybridtune.train.objectives.rewards import load_reward_funcs, reward_metrics, score, total_rewards

logger = logging.getLogger(__name__)


@dataclass
class PromptDoc(Example):
    """A prompt's tokens (nothing trained), the row's other columns and where the row is."""

    columns: dict = field(default_factory=dict)
    prompt: Any = None
    where: str = ""


@dataclass
class PromptData:
    prompts: list[PromptDoc]
    max_completion_length: int

    def train_lengths(self) -> list[int]:
        return [len(p) + self.max_completion_length for p in self.prompts]


MEDIA_PARTS = ("image", "image_url", "input_image", "video", "video_url", "audio", "input_audio")


def _refuse_media(row: dict, ds, where: str) -> None:
    """One line naming the row when it carries images, videos or audio: a media column (LLaMA-Factory's, or TRL's
    `image`), a media content part in its prompt or chat, or a media placeholder in their text."""
    what = next((f"column '{c}'" for c in ("image", *MEDIA_COLUMNS) if row.get(c) not in (None, "", [], "[]")), None)
    for key in (ds.field_prompt, ds.field_messages):
        value = row.get(key)
        for j, m in enumerate(value if isinstance(value, list) else []):
            content = m.get(ds.message_field_content) if isinstance(m, dict) else None
            for k, part in enumerate(content if isinstance(content, list) else []):
                kind = part.get("type") if isinstance(part, dict) else None
                if what is None and kind in MEDIA_PARTS:
                    what = f"message {j} of '{key}', content part {k} (type '{kind}')"
        mark = next((p for p in MEDIA_PLACEHOLDERS if p in str(value)), None) if value is not None else None
        if what is None and mark:
            what = f"an {mark} placeholder in field '{key}'"
    if what is not None:
        raise DataError(
            f"{where}: the row carries media ({what}); objective grpo samples from text prompts only for now (on a "
            "vision-language checkpoint too): drop the row's images, videos and placeholders, or train on them with "
            "objective sft"
        )


REWARD_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state")  # what a reward is given besides


def _prompt_of(row: dict, ds, where: str) -> tuple[Any, dict]:
    """(the prompt as the row gives it, the other columns); see the module doc."""
    _refuse_media(row, ds, where)
    if taken := [k for k in REWARD_KEYWORDS if k in row]:
        raise DataError(
            f"{where}: column '{taken[0]}' has the name of a keyword every reward function is given "
            f"({', '.join(REWARD_KEYWORDS)}); rename the column"
        )
    if ds.field_prompt in row:
        prompt = row[ds.field_prompt]
        columns = {k: v for k, v in row.items() if k != ds.field_prompt}
        if isinstance(prompt, list):  # messages: each checked as training data's are (one line naming the row)
            return parse_messages(prompt, "chat", ds, where, ds.field_prompt), columns
        text = field_text(prompt, where, f"field '{ds.field_prompt}' (text or a list of messages)")
        if not text.strip():
            raise DataError(f"{where}: field '{ds.field_prompt}' is empty; give the prompt or drop the row")
        return text, columns
    messages = row.get(ds.field_messages)
    if ds.field_messages in row:
        messages = parse_messages(messages, "chat", ds, where, ds.field_messages)
    if isinstance(messages, list) and messages:
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
        columns = {k: v for k, v in row.items() if k != ds.field_messages}
        if last is None:
            return messages, columns
        columns.setdefault("answer", messages[last].get("content"))
        if last == 0:
            raise DataError(f"{where}: the chat has no message before its assistant reply; GRPO needs a prompt")
        return messages[:last], columns
    raise DataError(
        f"{where}: objective grpo reads a '{ds.field_prompt}' (text or messages) or a '{ds.field_messages}' chat "
        f"from each row; this row has {sorted(row)}"
    )


def load_prompts(cfg: TrainConfig, tokenizer, vision=None) -> PromptData:
    """Every data source's prompts, tokenised (chat prompts through the template), cut to max_prompt_length.
    `vision` (a vision-language checkpoint's): unused, the prompts being text (`_refuse_media`)."""
    docs: list[PromptDoc] = []
    kwargs = cfg.chat_template_kwargs or None
    for ds in cfg.resolved_datasets():
        src = open_source(ds)
        for where, row in src.rows():
            row = decode_json_cells(row, (ds.field_prompt, ds.field_messages))
            prompt, columns = _prompt_of(row, ds, where)
            text = prompt if isinstance(prompt, str) else render(tokenizer, prompt, generation_prompt=True,
                                                                 template_kwargs=kwargs)  # fmt: skip
            ids = tokenizer(text, add_special_tokens=isinstance(prompt, str))["input_ids"][-cfg.max_prompt_length :]
            if not ids:
                raise DataError(f"{where}: the prompt is empty")
            docs.append(PromptDoc(ids, [0] * len(ids), columns=columns, prompt=prompt, where=where))
    if not docs:
        raise DataError("objective grpo found no prompts in the data")
    return PromptData(docs, cfg.max_completion_length)


def prepare_prompts(cfg: TrainConfig, tokenizer, loaded: PromptData) -> PreparedData:
    """One prompt a bin (a micro-batch of micro_batch_size prompts); nothing held out (no eval loss for grpo)."""
    n = len(loaded.prompts)
    stats = PackStats(examples_in=n, examples_packed=n, bins=n, tokens=sum(map(len, loaded.prompts)))
    stats.capacity = stats.tokens
    logger.info(
        "data: %d prompts; each step samples %d completions of each of its %d prompts (micro_batch_size x "
        "gradient_accumulation_steps)",
        n, cfg.num_generations, cfg.micro_batch_size * cfg.gradient_accumulation_steps,
    )  # fmt: skip
    return PreparedData([[p] for p in loaded.prompts], [], stats, [], [], cfg.sequence_len)


def preview_prompts(cfg: TrainConfig, tokenizer, vision, rows: int, out: TextIO) -> PreparedData:
    """`hybridtune data` for grpo: each prompt as the model is given it (the chat template's generation prompt), its
    tokens and the columns its rewards read; then what a step samples (train's own prompt loading)."""
    loaded = load_prompts(cfg, tokenizer, vision)
    data = prepare_prompts(cfg, tokenizer, loaded)
    print(f"prompts for {printable(cfg.base_model)}'s tokenizer (objective grpo: nothing here is trained; the "
          f"completions are sampled), max_prompt_length {cfg.max_prompt_length}", file=out)  # fmt: skip
    for doc in loaded.prompts[:rows]:
        columns = ", ".join(f"{k}={str(v)[:60]!r}" for k, v in doc.columns.items()) or "none"
        print(printable(f"\n--- {doc.where} (prompt): {len(doc)} tokens; columns for the rewards: {columns}"), file=out)
        text = tokenizer.decode(doc.input_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        print(printable(text), file=out)
    batch = cfg.micro_batch_size * cfg.gradient_accumulation_steps
    print(f"\nprompts: {len(loaded.prompts)}; each step samples {cfg.num_generations} completions of up to "
          f"{cfg.max_completion_length} tokens for each of its {batch} prompt{'s' * (batch != 1)}, scored by "
          f"{', '.join(cfg.reward_funcs) or '(no reward_funcs: train refuses)'}", file=out)  # fmt: skip
    return data


class Rollouts:
    """Each step's window for an on-policy objective (see the module doc)."""

    def __init__(self, cfg: TrainConfig, objective, tokenizer, model, device, autocast=None, world: int = 1):
        if world > 1:
            raise ConfigError("objective grpo runs in one process for now; drop --nproc / torchrun")
        # why here: `transformers.TrainerState`'s module loads transformers' trainer stack (torchao with it), which
        # every import of train.objectives (`hybridtune eval`, `data`, `bench`) would pay for at its start
        from transformers import TrainerState

        self.state_class = TrainerState  # (the `trainer_state` each reward call is given, as TRL gives it)
        self.cfg, self.objective, self.tokenizer, self.model, self.device = cfg, objective, tokenizer, model, device
        self.funcs = load_reward_funcs(cfg.reward_funcs, cfg.max_completion_length, cfg.reward_processes,
                                       cfg.reward_timeout)  # fmt: skip
        self.stop = eos_ids(model, tokenizer)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (self.stop or [0])[0]
        self.collate = CompletionCollator(pad_token_id=self.pad)
        self.autocast = autocast
        self.batches: list[dict] = []
        self.lens: list[int] = []
        self.left = 0  # optimizer steps the current batch of completions still serves
        self.rewards: list[float] = []  # each rollout's mean reward, in this process (the `done:` line's trend)

    def _autocast(self):
        return self.autocast() if self.autocast is not None else contextlib.nullcontext()

    def window(self, stream, micro_batches: int, step: int) -> list[dict]:
        """The step's packs (on the device): completions of the stream's next `micro_batches` micro-batches of
        prompts when the last batch has served its num_iterations steps, else the last batch again."""
        if self.left == 0:
            prompts = [d for _ in range(micro_batches) for d in stream.next_docs()]
            self.batches = self._generate(prompts, step)
            self.left = self.cfg.num_iterations
        self.left -= 1
        return self.batches

    def _generate(self, prompts: list[PromptDoc], step: int) -> list[dict]:
        cfg, G = self.cfg, self.cfg.num_generations
        t0 = time.perf_counter()
        with self._autocast():
            groups = sample_groups(self.model, [p.input_ids for p in prompts], G, cfg.max_completion_length, self.stop,
                                   cfg.temperature, cfg.top_p, seed=(cfg.seed * 1_000_003 + step) << 24, pad_token_id=self.pad)  # fmt: skip
        gen_time = time.perf_counter() - t0
        rolls = [r for g in groups for r in g]
        texts = self.tokenizer.batch_decode([r.ids for r in rolls], skip_special_tokens=True)
        rows = [p for p in prompts for _ in range(G)]
        columns = {k: [p.columns.get(k) for p in rows] for k in {k for p in prompts for k in p.columns}}
        # As TRL gives them: a chat prompt's completion as the assistant's message, a plain prompt's as text.
        completions = [t if isinstance(p.prompt, str) else [{"role": "assistant", "content": t}]
                       for p, t in zip(rows, texts)]  # fmt: skip
        state = self.state_class(global_step=step, max_steps=max(cfg.max_steps, 0))
        rewards = score(self.funcs, [p.prompt for p in rows], completions, [r.ids for r in rolls], columns,
                        [p.where for p in rows], trainer_state=state)  # fmt: skip
        total = total_rewards(self.funcs, rewards, cfg.reward_weights, G, [p.where for p in rows], cfg.scale_rewards)
        adv = group_advantages(total, G, cfg.scale_rewards).tolist()
        comps = []
        for p, r, a in zip(rows, rolls, adv):
            train = 0 if (r.truncated and cfg.mask_truncated_completions) or not r.ids else 1
            ids = r.ids or [self.pad]  # (an empty completion cannot happen: decoding adds at least one token)
            comps.append(Completion(p.input_ids + ids, [0] * len(p) + [train] * len(ids), advantage=a))
        if cfg.mask_truncated_completions and all(r.truncated for r in rolls):
            logger.warning(
                "step %d: every completion (%d) reached max_completion_length %d and is masked "
                "(mask_truncated_completions: true), so this step trains nothing; raise max_completion_length, or set "
                "mask_truncated_completions: false", step + 1, len(rolls), cfg.max_completion_length,
            )  # fmt: skip
        seq_len = max([cfg.sequence_len, *map(len, comps)])
        bins = pack_completions(comps, seq_len)
        self.lens = [len(c) for b in bins for c in b]
        batches = [to_device(self.collate(b), self.device) for b in bins]
        with self._autocast():  # (old log-probs in the precision of the loss's forward)
            self.objective.prepare(self.model, batches)
        self.rewards.append(float(total.mean()))
        lengths = torch.tensor([len(r.ids) for r in rolls], dtype=torch.float64)
        self.objective.rollout = {
            **reward_metrics(self.funcs, rewards, total, G),
            "completions/mean_length": float(lengths.mean()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": sum(r.truncated for r in rolls) / len(rolls),
            "time/generation_s": gen_time,
            "gen_tokens_per_s": float(lengths.sum()) / max(gen_time, 1e-9),
        }
        return batches
