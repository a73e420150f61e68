"""The expert-parallel runtime: experts spread over ranks as a placement says, tokens sent to them
and back with torch.distributed all-to-all, and one engine loop for every rank.

The contract is docs/design.md, "Expert-parallel serving"; docs/expert_parallel.md has the detail.

Three concerns, lowest first (none imports a higher one):
    ep/           the data path: placement, layer, runtime, exchange, transport, groups, counters
    ep/ranks/     the rank processes: launch, worker, rank 0's driver, the control plane, messages
    ep/rebalance/ changing the placement while serving: window, replan, move, elastic
Which experts a rank holds is the model's (locus/engine/model/slices.py), so the loaders below this
package build a rank's model without importing it.

Glossary (the same words as docs/design.md). "Row" has one meaning in this package: a packet, one
token's packed bytes, a row of an exchange's uint8 buffers. A MoE layer's position is its MoE index
(`moe_index`), the model's decoder-layer number its layer, a token of a trace or of a routing window
a trace token, and what a moved request sends is its KV cache:
    node        a machine, or a group of ranks that counts as one: node n holds ranks n*G .. n*G+G-1
    rank        one process, one GPU's worth of work; node-major, rank r on node r // G
    local index a rank's place in its node, r % G
    expert      a logical expert id e in 0..E-1 of one MoE layer, as the router numbers it
    slot        one place for one expert's weights on one rank in one MoE layer; local slot j of rank r
                is physical slot p = r * S + j (S slots per rank)
    replica     a slot holding a given expert; every expert has at least one per MoE layer, and a rank
                may hold one expert in two slots
    placement   which expert every slot holds (`ExpertPlacement`; its file form is a placement plan)
    tier        tier 1 crosses nodes (the inter-node bytes), tier 2 stays within a node (intra-node)
    proxy       the rank of a remote node with the source's local index: tier 1 sends a token there
                once, it forwards the token over tier 2 and adds the partial sums on the way back
    lane        one stream of MoE exchanges with its own process groups; two with --ep-overlap
    epoch       the number of the placement a step ran under: 0 at launch, +1 at every switch (each
                group of MoE layers a live re-plan moves, a re-plan onto survivors)
    MoE index   l in 0..L-1, a MoE layer's position in `moe_layers`, the first axis of a plan's slots
                (code: `moe_index`; a count of MoE layers is `layers_per_step`, `done_layers`); the
                model's own layer number is its layer, moe_layers[l] (code: `layer`, `moe_layer`)
    packet      one token's bytes on the exchange: [x | K slot ids | K weights | padding], one row of
                the exchange's buffers (`RowFormat`, `row_bytes`; the only "row" here); x is the
                payload, ids and weights the metadata
    trace token one token's [L, K] routing in a trace; a routing window holds W of them
                (`WindowTokens`)
    iteration   one lockstep round: the control exchange, then (if anyone has work) one engine step
    window      the routing of the last W tokens a rank keeps for a live re-plan
    survivor    a rank still running after another was lost; regroup: survivors forming a new group
"""
