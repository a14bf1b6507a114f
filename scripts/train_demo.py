"""Train the shipped demo LVLM family (target, draft/captioner, tokenizer) from scratch on this CPU.

    python scripts/train_demo.py                  # writes mmspec_cli/shipped/demo-{target,draft}
    python scripts/train_demo.py --out /tmp/demo  # somewhere else
    python scripts/train_demo.py --target-from mmspec_cli/shipped   # retrain only the draft

Deterministic: fixed seeds, a fixed number of torch threads (``BuildPlan.threads``) and
deterministic algorithms. The measured time of each stage goes to ``<out>/training.json``
beside the weights.
"""

from __future__ import annotations

import argparse
import time

from mmspec_cli.demo.training.build import BuildPlan, build
from mmspec_cli.demo.quality import answer_questions, score_answers
from mmspec_cli.demo.tasks import quality_questions
from mmspec_cli.models.loading import shipped_models_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(shipped_models_dir()), help="folder for demo-target/ and demo-draft/")
    parser.add_argument("--target-from", default=None, metavar="DIR",
                        help="reuse DIR/demo-target (built by this script) and train only the draft")
    parser.add_argument("--probe", type=int, default=0, metavar="N",
                        help="every --probe-every steps, print the model's score on N held-out colour/count questions")
    parser.add_argument("--probe-every", type=int, default=1000, metavar="STEPS")
    args = parser.parse_args()
    start = time.perf_counter()
    questions = quality_questions(args.probe)

    def probe(name, model, processor):
        score = score_answers(questions, answer_questions(model, processor, questions))
        print(f"{name}: {sum(score.final)}/{len(questions)} held-out colour/count final answers right "
              f"({sum(score.strict)} strictly)", flush=True)

    report = build(args.out, BuildPlan(), log=lambda line: print(line, flush=True), probe=probe if args.probe else None,
                   probe_every=args.probe_every,
                   target_from=args.target_from)
    print(f"done in {time.perf_counter() - start:.0f} s; language-model parameters {report.language_model_parameters}; "
          f"final loss {report.final_loss}; vision patch accuracy {report.vision_patch_accuracy:.3f}")


if __name__ == "__main__":
    main()
