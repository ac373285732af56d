"""OpenAI's API shapes, owned by neither door: `kvrq serve` (producer/http/) and `kvrq batch run`
(producer/batch/) both map bodies and answer with these.

- bodies.py: chat and completions request bodies to GenerationRequest fields (BodyError when one
  cannot run);
- answers.py: results to chat.completion / text_completion bodies, usage and logprobs.
"""
