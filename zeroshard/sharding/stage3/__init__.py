"""Stage 3: parameters live as shards and are gathered per unit of modules around its forward and
backward; ``zeroshard.Init`` builds a model already sharded, ``GatheredParameters`` gathers on request."""
