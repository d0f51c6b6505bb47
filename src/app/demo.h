// `nebula demo`: the whole story on one machine, stage by stage, each stage an
// ordinary local-mode job (launcher.h) with its own run directory and files:
//
//   RUN/corpus          `nebula corpus build` of this machine's gettext catalogs (de, fr, es, it)
//   RUN/pretrain        multilingual MLM + TLM pre-training on two sites that hold different
//                       languages, over an emulated WAN, with the adaptive strategy ([4/7])
//   RUN/pretrain-sync   the same steps with synchronous data parallel (equal tokens)
//   RUN/transfer        zero-shot transfer: a package classifier (linear probe) on the
//                       pre-trained encoder, trained on English, scored in de/es/fr/it
//   RUN/transfer-random the same on a randomly initialised encoder (the baseline)
//   RUN/teacher         the en→de teacher on site europe-west, with the translation vocabulary
//                       it trains on that site's pairs (RUN/teacher/tokenizer.model)
//   RUN/student-kd      the student on europe-south, distilled from the teacher across the WAN
//   RUN/student         the same student without distillation (the baseline)
//   RUN/peft-full       the teacher adapted on both sites with sync, every parameter trained
//   RUN/peft-lora       the same with LoRA (only its values cross the WAN)
//   RUN/summary.json, RUN/summary.md, RUN/*.svg   the table and the charts
//
// quick = a tiny version of every stage (for tests): under a minute instead of about sixteen.
#pragma once

#include <string>
#include <vector>

namespace nebula::app {

struct DemoOptions {
  std::string run_dir = "runs/demo";
  bool quick = false;
  std::string executable;              // the nebula binary (workers are spawned with it)
  std::string pretrain_config;         // examples/demo.toml's text
  std::string translate_config;        // examples/demo_mt.toml's text
  std::string transfer_config;         // examples/transfer.toml's text
  std::vector<std::string> overrides;  // --set: applied to the pre-training config
};

// Returns the exit code (0 when every stage finished).
int run_demo(const DemoOptions& options);

}  // namespace nebula::app
