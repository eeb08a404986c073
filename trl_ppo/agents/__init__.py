"""Agents: multi-turn episodes in which the policy calls tools or acts in an environment (issue 25).

`tools` (schemas of plain functions and environment methods), `environments` (one instance per episode),
`execution` (running a turn's tool calls; failures become answers), `chat` (parsing calls and rendering answers
as token ids with the tokenizer's templates), `templates` (a stock model family's parser and training-safe
template, from TRL's registry), `turn_loop` (the turns, and the `Rollout` they fill), `runner`
(`AgentRunner`, what `PPOTrainer` holds with `tools=` / `environment_factory=`), `tiny_chat` (an offline
tool-calling tokenizer for tests and examples)."""
