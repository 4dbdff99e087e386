"""The embedded default: the recipe that builds the tiny chat+math target (and, later, its
drafters) from ShareGPT and GSM8K, on CPUs, in about two hours."""
