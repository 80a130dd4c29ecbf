"""How much does the OPSD teacher know more than the student? (docs/agents.md, OPSD results)

On-policy self-distillation (asyncrl/agents/opsd.py) trains each token on the teacher-minus-
student log-ratio, where the teacher is the policy given privileged context (the gold answer).
That signal is only as good as the teacher: this probe measures, on the base model and a
config's training problems,

* the teacher's sampled accuracy for each place the privileged context can go (a system message
  before the prompt, ``agent.opsd_hint: system``; a note appended to the user message,
  ``agent.opsd_hint: user``; and, for comparison, the hint appended to the task's own system
  prompt), next to the student's;
* on the student's own samples, the log-ratio summed over a sample, for right and for wrong
  answers (a usable signal separates them), and its mean per token on digit and other tokens.

    python bench/opsd_teacher_probe.py [--config configs/smollm2_arith_opsd.yaml] [--problems 24] [--samples 4] [--model PATH]

Prints a table; ``--json F`` writes the numbers. Single process, HF ``generate`` on the CPU
threads given by ``--threads``; a minute or two for the defaults.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from asyncrl.agents.chat import ChatFormat  # noqa: E402
from asyncrl.core.config import load_config  # noqa: E402
from asyncrl.models import load_causal_lm, load_tokenizer  # noqa: E402
from asyncrl.tasks.rewards import check_answer  # noqa: E402
from asyncrl.tasks.tasks import load_task, render_prompt, render_response_prefix  # noqa: E402

SYSTEM_HINT = "The correct final answer is {gold}. Answer as if you had worked it out yourself."  # opsd.gold_answer_hint
USER_NOTE = "(The answer is {gold}.)"  # opsd.gold_answer_note


def token_logprobs(model, prompt_ids: list[int], target: list[int]) -> list[float]:
    """log p(target_t | prompt, target_<t) for each t, shape (T,)."""
    ids = torch.tensor([prompt_ids + target])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(target)[:, None])[:, 0].tolist()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/smollm2_arith_opsd.yaml")
    ap.add_argument("--model", default=None, help="model name or path (default: the config's model.path)")
    ap.add_argument("--problems", type=int, default=24)
    ap.add_argument("--samples", type=int, default=4, help="samples per problem and prompt variant")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = load_config(config_path=args.config)
    model_path = args.model or cfg.model.path
    tok = load_tokenizer(model_path)
    model = load_causal_lm(model_path).eval()
    chat = ChatFormat(tok)
    task = load_task(cfg.data, seed=cfg.run.seed)
    max_new = min(24, cfg.rollout.max_response_len)
    correct: dict[str, list[bool]] = {}
    seq_sums: dict[str, dict[str, list[float]]] = {}
    per_token: dict[str, dict[str, list[float]]] = {}
    for i in range(args.problems):
        p = task.train_problem(i)
        prefill = render_response_prefix(cfg.data.response_prefix, p.metadata)
        student = render_prompt(tok, p.text, cfg.data.system_prompt, prefill)[1]
        variants = {
            "student": student,
            "system message (opsd_hint system)": chat.message_ids(SYSTEM_HINT.format(gold=p.gold), "system") + student,
            "user note (opsd_hint user)": chat.with_user_note_ids(student, USER_NOTE.format(gold=p.gold)),
            "appended to the task's system prompt": render_prompt(
                tok, p.text, f"{cfg.data.system_prompt} The correct final answer is {p.gold}.", prefill)[1],
        }
        for name, ids in variants.items():
            with torch.no_grad():
                out = model.generate(torch.tensor([ids] * args.samples), attention_mask=torch.ones(args.samples, len(ids)),
                                     do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new,
                                     pad_token_id=tok.eos_token_id)
            for row in out[:, len(ids):].tolist():
                if tok.eos_token_id in row:
                    row = row[:row.index(tok.eos_token_id) + 1]
                ok = check_answer(prefill + tok.decode(row, skip_special_tokens=True), p.gold).correct
                correct.setdefault(name, []).append(bool(ok))
                if name != "student":
                    continue
                s = token_logprobs(model, ids, row)
                for teacher_name, tids in variants.items():
                    if teacher_name == "student":
                        continue
                    d = [t - u for t, u in zip(token_logprobs(model, tids, row), s)]
                    seq_sums.setdefault(teacher_name, {}).setdefault("right" if ok else "wrong", []).append(sum(d))
                    for k, x in enumerate(d):
                        kind = "digit" if any(c.isdigit() for c in tok.decode([row[k]])) else "other"
                        per_token.setdefault(teacher_name, {}).setdefault(kind, []).append(x)
    mean = lambda xs: statistics.mean(xs) if xs else float("nan")  # noqa: E731
    result = {"config": args.config, "problems": args.problems, "samples": args.samples,
              "sampled_accuracy": {k: mean([float(x) for x in v]) for k, v in correct.items()},
              "logratio_sum_per_sample": {k: {c: mean(v) for c, v in d.items()} for k, d in seq_sums.items()},
              "logratio_mean_per_token": {k: {c: mean(v) for c, v in d.items()} for k, d in per_token.items()}}
    print(f"{'prompt':40s} {'sampled acc':>11s} {'log-ratio sum: right':>21s} {'wrong':>7s} {'per token: digit':>17s} {'other':>7s}")
    for name, acc in result["sampled_accuracy"].items():
        ss = result["logratio_sum_per_sample"].get(name, {})
        pt = result["logratio_mean_per_token"].get(name, {})
        print(f"{name:40s} {acc:11.2f} {ss.get('right', float('nan')):21.2f} {ss.get('wrong', float('nan')):7.2f} "
              f"{pt.get('digit', float('nan')):17.3f} {pt.get('other', float('nan')):7.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
