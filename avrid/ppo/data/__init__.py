"""The data of a step: which prompts it reads, and the columns its batch grows.

Read in this order:

1. prompts.py  `PromptSet` (a split, tokenized and checked), `step_indices` (which prompts
               step k reads: a function of the step, so resume is exact), `prompt_batch`,
               `mini_batches`
2. columns.py  the PPO batch's columns: `with_responses`, `add_columns`, the packed <->
               padded views every phase reads (`padded`, `packed`, `response_mask`,
               `action_mask`: chapter 7's policy tokens), the model's inputs, and `Totals`
               (the loss's global denominators)
3. credit.py   `compute_advantages`: shaped scores and token rewards, handed to the
               estimator `algo.name` names (`algo/registry.py`)
4. dynamic_sampling.py  DAPO's dynamic sampling: drop all-alike groups, draw more rounds

Pure: no Ray and no models. Chapter 2's `Batch` is the container; this package names what
PPO puts in it.
"""
