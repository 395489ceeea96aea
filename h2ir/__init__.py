"""h2ir: the IR, standardized op set, costs, plans, search and compiler of h2."""
