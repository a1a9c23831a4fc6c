"""`hybridtune data --objective grpo`: the prompts as the model is given them (the chat template's generation
prompt, cut to max_prompt_length as training cuts them), the columns the rewards read, and what a step samples;
it showed them as SFT rows packed into bins with their answers marked trained, which grpo never trains on."""

from __future__ import annotations

import json

from hybridtune.cli import main


def test_data_shows_grpo_prompts_not_packed_answers(tmp_path, capsys):
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{a}="}], "answer": str(2 * a)} for a in range(5)]
    rows.append({"prompt": "plain text prompt " * 40, "answer": "0"})  # a text prompt, longer than the cut
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["data", "--objective", "grpo", "--reward_funcs", "exact_answer", "--dataset", str(data)]
    args += ["--max_prompt_length", "16", "--num_generations", "4", "--gradient_accumulation_steps", "2"]
    assert main([*args, "--rows", "6"]) == 0
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if line.startswith("--- ")]
    assert len(heads) == 6 and heads[0].endswith("(prompt): 12 tokens; columns for the rewards: answer='0'"), heads
    assert "(prompt): 16 tokens;" in heads[5]  # cut to max_prompt_length, its last tokens kept
    assert "<|im_start|>user\n3+3=<|im_end|>\n<|im_start|>assistant\n" in out  # the generation prompt
    assert "[[" not in out and "packing:" not in out  # nothing marked trained, no bins
    assert out.rstrip().endswith(
        "prompts: 6; each step samples 4 completions of up to 256 tokens for each of its 2 prompts, scored by "
        "exact_answer"
    )
