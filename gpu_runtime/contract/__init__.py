"""Rules the control plane and the runtime hosts share, in one place (imports neither torch nor
Django, so the web process can use them):

* `training_data` — JSONL training files to token sequences with loss labels, the format
  names, and the longest example a job may train on (`training_max_seq_len`);
* `training_examples` — what one line becomes (a tokenized example, a preference pair), the
  error a record that breaks its format raises, and the shape of one chat message;
* `supervised_examples` — the chat and prompt/completion formats, record to tokens;
* `preference_examples` — the preference (DPO) format, record to a pair of token rows;
* `training_files` — the upload check of a training file (every bad line, no tokenizer) and
  the formats each job method trains on;
* `chat` — rendering a conversation with the tokenizer's chat template, and its assistant spans;
* `tokenizer` — the training tokenizer of a base model, loaded from its tokenizer files;
* `published_tokenizer` — the tokenizer files and manifest a host publishes to storage;
* `tiny_tokenizer` — the tiny built-in model's tokenizer;
* `model_config` — a model's shape (`ModelConfig`, its presets, the HF `config.json` form);
* `hparams` — a job's hyperparameters: ranges, LoRA defaults, "auto" as hosts resolve it;
* `footprint` — the memory a LoRA job borrows on its host (adapter state, activations);
* `statistics` — the one percentile definition of reports, result files and the console;
* `protocol` — the messages between the control plane and the host agents (commands, reports,
  storage keys, fine-tuned model names);
* `storage` — the object store both halves read and write (training files, checkpoints,
  adapters, published tokenizers).
"""
