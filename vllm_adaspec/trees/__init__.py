"""Token trees: the draft tree, its shapes, and verification (greedy, lossless sampling, lossy typical). No vLLM."""

from vllm_adaspec.trees.build import (GrowingTree, admit_within, copy_capacity, add_children, best_subtree, cartesian_choices, fill_tokens,
                                      grow_by_path_probability, shape_from_choices, to_expand)
from vllm_adaspec.trees.batch import TreeBatch, pack_trees, verify_greedy_batch, verify_sample_batch
from vllm_adaspec.trees.tree import DraftTree, ancestor_bits, ancestor_mask, depth_positions, paths
from vllm_adaspec.trees.verify import verify_greedy, verify_rrs, verify_sample_match, verify_typical

__all__ = ["DraftTree", "ancestor_mask", "ancestor_bits", "depth_positions", "paths", "shape_from_choices",
           "cartesian_choices", "fill_tokens", "grow_by_path_probability", "GrowingTree", "add_children", "to_expand",
           "best_subtree", "admit_within", "copy_capacity", "verify_greedy", "verify_greedy_batch", "verify_sample_batch", "TreeBatch", "pack_trees", "verify_sample_match", "verify_rrs", "verify_typical"]
