"""The run check's payload, controller side: request (what is sent to the agent's `run-check`
operation, how its answer reads) and the two scripts sent with remote/run_check_driver.py, standard
library only at module level: tiny_model (a tiny random Llama made on the spot, run as a script)
and extract (the extraction driver: speculators' generator through vLLM, checked against
transformers). The demo, the release matrix and the tests run the same two scripts."""
