"""Agents: multi-turn episodes in which the policy calls tools or acts in an environment (issue 25).

`tools` (schemas of plain functions and environment methods), `environments` (one instance per episode),
`execution` (running a turn's tool calls; failures become answers), `chat` (parsing calls and rendering answers
as token ids with the tokenizer's templates). The turn loop that fills a `Rollout` from them is not written yet."""
