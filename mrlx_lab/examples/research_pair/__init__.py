"""A DeepResearch-style pair as agent code on two models: a planner delegates, a searcher searches
a small corpus with a tool and reports back (`hooks`, `corpus`)."""
