"""The engine core both worker roles run: one thread owns the model and runs prompt passes and decode steps.

- scheduler.py: which prompts the next prompt pass runs (short ones batched, long ones chunked);
- prompts.py: the prompt queue and its passes, which sample each prompt's first token and hand its KV on;
- validation.py: what a worker checks of a request before the engine takes it (prompt length, vocabulary);
- sequence.py: a request as the decode batch sees it;
- batch.py: the continuous decode batch over the paged KV cache;
- core.py: the loop, configured by role (a prefill worker runs prompts only; a decode worker runs its batch and
  the colocated prompts between steps);
- client.py: the services' side of it: every hop between the engine thread and a servicer's event loop.
"""
