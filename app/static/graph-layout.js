// The layered layout of a workflow for graph.js: where each block's node goes and the
// path of each edge, left to right by dependency. Pure: no DOM, only numbers.
//
// The classic steps for a DAG (Sugiyama's), each in its simplest form that is good enough
// for a workflow of at most 500 blocks and 2,000 edges (SPEC §8), laid out in about
// 50 ms: longest-path layers, with each block then moved as late as its dependents
// allow; long edges broken by virtual items, one per layer crossed (within a budget);
// barycentric ordering sweeps, keeping the order with the fewest crossings; rows by
// isotonic regression (pool-adjacent-violators) towards each item's neighbours.
"use strict";

const LAYOUT = Object.freeze({
  NODE_W: 176,
  NODE_H: 46,
  ROW_GAP: 16,
  LAYER_GAP: 56,
  LABEL_CHARS: 34, // a longer condition is cut short (the tooltip has all of it)
  CHAR_W: 6.7, // an 11px monospace character, for the label's box
  DUMMY_BUDGET: 6000, // virtual items for long edges; past it, an edge goes straight
});

function cutText(text, max) {
  return text.length > max ? `${text.slice(0, max - 1)}…` : text;
}

/**
 * Positions for a workflow's blocks and paths for its edges, left to right by layer.
 * Returns {nodes: [{id, type, x, y}], edges: [{from, to, when, d, label: {x, y}}], width, height}.
 */
function layoutWorkflow(workflow) {
  const { NODE_W, NODE_H, ROW_GAP, LAYER_GAP, LABEL_CHARS, CHAR_W, DUMMY_BUDGET } = LAYOUT;
  const blocks = workflow.blocks || [];
  const n = blocks.length;
  const index = new Map(blocks.map((block, i) => [block.id, i]));
  const edges = (workflow.edges || [])
    .filter((e) => index.has(e.from) && index.has(e.to) && e.from !== e.to)
    .map((e) => ({ from: index.get(e.from), to: index.get(e.to), when: e.when || null }));
  const succ = blocks.map(() => []);
  const pred = blocks.map(() => []);
  for (const e of edges) {
    succ[e.from].push(e.to);
    pred[e.to].push(e.from);
  }

  // Topological order, workflow order among the ready (the server refused cycles;
  // anything left over is appended so a bad definition still draws).
  const waiting = pred.map((p) => p.length);
  const order = [];
  for (let i = 0; i < n; i += 1) if (waiting[i] === 0) order.push(i);
  for (let head = 0; head < order.length; head += 1) {
    for (const s of succ[order[head]]) if (--waiting[s] === 0) order.push(s);
  }
  if (order.length < n) {
    const seen = new Set(order);
    for (let i = 0; i < n; i += 1) if (!seen.has(i)) order.push(i);
  }

  // Longest-path layers, then each block with dependents as late as they allow: a
  // source that only the last block reads sits beside it, not a whole row away.
  const layerOf = new Array(n).fill(0);
  for (const v of order) for (const s of succ[v]) layerOf[s] = Math.max(layerOf[s], layerOf[v] + 1);
  for (let i = order.length - 1; i >= 0; i -= 1) {
    const v = order[i];
    if (succ[v].length === 0) continue;
    const latest = Math.min(...succ[v].map((s) => layerOf[s])) - 1;
    if (latest > layerOf[v]) layerOf[v] = latest;
  }

  // Items: the blocks, then one virtual item per layer crossed by a long edge.
  const items = blocks.map((_, i) => ({ layer: layerOf[i], real: true, up: [], down: [] }));
  let budget = DUMMY_BUDGET;
  for (const e of edges) {
    const span = items[e.to].layer - items[e.from].layer;
    e.chain = [e.from];
    if (span > 1 && span - 1 <= budget) {
      budget -= span - 1;
      for (let l = items[e.from].layer + 1; l < items[e.to].layer; l += 1) {
        e.chain.push(items.length);
        items.push({ layer: l, real: false, up: [], down: [] });
      }
    }
    e.chain.push(e.to);
    for (let k = 1; k < e.chain.length; k += 1) {
      items[e.chain[k - 1]].down.push(e.chain[k]);
      items[e.chain[k]].up.push(e.chain[k - 1]);
    }
  }
  const depth = n ? Math.max(...layerOf) + 1 : 0;
  const layers = Array.from({ length: depth }, () => []);
  for (const v of order) layers[items[v].layer].push(v);
  for (let v = n; v < items.length; v += 1) layers[items[v].layer].push(v);
  const pos = new Array(items.length);
  const number = (layer) => layer.forEach((v, i) => { pos[v] = i; });
  layers.forEach(number);

  // Barycentric sweeps, down then up, keeping the order with the fewest crossings.
  const sweep = (l, side) => {
    const key = new Map();
    for (const v of layers[l]) {
      const near = items[v][side];
      key.set(v, near.length ? near.reduce((sum, u) => sum + pos[u], 0) / near.length : pos[v]);
    }
    layers[l].sort((a, b) => key.get(a) - key.get(b) || pos[a] - pos[b]);
    number(layers[l]);
  };
  const crossings = () => {
    let total = 0;
    for (let l = 0; l + 1 < depth; l += 1) {
      const pairs = [];
      for (const u of layers[l]) {
        for (const w of items[u].down) if (items[w].layer === l + 1) pairs.push([pos[u], pos[w]]);
      }
      pairs.sort((a, b) => a[0] - b[0] || a[1] - b[1]);
      // Inversions of the lower ends, counted with a Fenwick tree.
      const size = layers[l + 1].length;
      const tree = new Array(size + 1).fill(0);
      let seen = 0;
      for (const [, w] of pairs) {
        let atOrBelow = 0;
        for (let i = w + 1; i > 0; i -= i & -i) atOrBelow += tree[i];
        total += seen - atOrBelow;
        for (let i = w + 1; i <= size; i += i & -i) tree[i] += 1;
        seen += 1;
      }
    }
    return total;
  };
  let best = layers.map((layer) => layer.slice());
  let fewest = crossings();
  for (let round = 0; round < 12 && fewest > 0; round += 1) {
    if (round % 2 === 0) for (let l = 1; l < depth; l += 1) sweep(l, "up");
    else for (let l = depth - 2; l >= 0; l -= 1) sweep(l, "down");
    const now = crossings();
    if (now < fewest) {
      fewest = now;
      best = layers.map((layer) => layer.slice());
    }
  }
  best.forEach((layer, l) => {
    layers[l] = layer;
    number(layer);
  });

  // Rows: each item as near its neighbours' mean as the order and spacing allow
  // (pool-adjacent-violators on y minus each item's minimum offset in its layer).
  const height = (v) => (items[v].real ? NODE_H : 0);
  const gap = (a, b) => (items[a].real && items[b].real ? ROW_GAP : items[a].real || items[b].real ? 10 : 6);
  const y = new Array(items.length);
  for (const layer of layers) {
    let at = 0;
    layer.forEach((v, i) => {
      if (i > 0) at += (height(layer[i - 1]) + height(v)) / 2 + gap(layer[i - 1], v);
      y[v] = at;
    });
  }
  const place = (layer, sides) => {
    const offsets = [];
    let at = 0;
    layer.forEach((v, i) => {
      if (i > 0) at += (height(layer[i - 1]) + height(v)) / 2 + gap(layer[i - 1], v);
      offsets.push(at);
    });
    const blocksOf = []; // [sum, count] of merged targets
    layer.forEach((v, i) => {
      const near = sides.flatMap((side) => items[v][side]);
      const want = near.length ? near.reduce((sum, u) => sum + y[u], 0) / near.length : y[v];
      blocksOf.push({ sum: want - offsets[i], count: 1 });
      while (blocksOf.length > 1) {
        const last = blocksOf[blocksOf.length - 1];
        const before = blocksOf[blocksOf.length - 2];
        if (before.sum / before.count <= last.sum / last.count) break;
        before.sum += last.sum;
        before.count += last.count;
        blocksOf.pop();
      }
    });
    let i = 0;
    for (const merged of blocksOf) {
      for (let k = 0; k < merged.count; k += 1, i += 1) y[layer[i]] = merged.sum / merged.count + offsets[i];
    }
  };
  const passes = [["up"], ["down"], ["up"], ["down"], ["up", "down"], ["up", "down"]];
  for (const sides of passes) {
    const range = sides[0] === "down" ? [...layers.keys()].reverse() : [...layers.keys()];
    for (const l of range) place(layers[l], sides);
  }
  let top = Infinity;
  let bottom = -Infinity;
  for (let v = 0; v < items.length; v += 1) {
    top = Math.min(top, y[v] - height(v) / 2);
    bottom = Math.max(bottom, y[v] + height(v) / 2);
  }
  if (!items.length) top = bottom = 0;

  // Columns: the gap before a layer is wide enough for the conditions that enter it.
  const labelWidth = new Array(depth).fill(0);
  for (const e of edges) {
    if (e.when) {
      const l = items[e.to].layer;
      labelWidth[l] = Math.max(labelWidth[l], Math.min(e.when.length, LABEL_CHARS) * CHAR_W + 10);
    }
  }
  const columnX = [];
  let x = 0;
  for (let l = 0; l < depth; l += 1) {
    if (l > 0) x += NODE_W + Math.max(LAYER_GAP, labelWidth[l] + 28);
    columnX.push(x);
  }

  // Ports: a block's edges leave and arrive spread along its side, in row order.
  const spread = (list, rowOf) => {
    const sorted = list.slice().sort((a, b) => rowOf(a) - rowOf(b));
    const step = Math.min(8, (NODE_H - 16) / Math.max(1, sorted.length - 1));
    return new Map(sorted.map((e, i) => [e, (i - (sorted.length - 1) / 2) * step]));
  };
  const outPort = new Map();
  const inPort = new Map();
  const outgoing = blocks.map(() => []);
  const arriving = blocks.map(() => []);
  for (const e of edges) {
    outgoing[e.from].push(e);
    arriving[e.to].push(e);
  }
  for (let v = 0; v < n; v += 1) {
    for (const [e, offset] of spread(outgoing[v], (edge) => y[edge.chain[1]])) outPort.set(e, offset);
    for (const [e, offset] of spread(arriving[v], (edge) => y[edge.chain[edge.chain.length - 2]])) inPort.set(e, offset);
  }

  const curve = (a, b) => {
    const mid = (a[0] + b[0]) / 2;
    return `C${mid} ${a[1]} ${mid} ${b[1]} ${b[0]} ${b[1]}`;
  };
  const placedEdges = edges.map((e) => {
    const points = [[columnX[items[e.from].layer] + NODE_W, y[e.from] - top + outPort.get(e)]];
    for (const v of e.chain.slice(1, -1)) {
      const cx = columnX[items[v].layer];
      points.push([cx, y[v] - top], [cx + NODE_W, y[v] - top]);
    }
    const end = [columnX[items[e.to].layer] - 1, y[e.to] - top + inPort.get(e)];
    points.push(end);
    let d = `M${points[0][0]} ${points[0][1]}`;
    for (let k = 1; k < points.length; k += 1) {
      // Between columns a curve; across a column a virtual item's straight run.
      d += k % 2 === 1 ? curve(points[k - 1], points[k]) : `L${points[k][0]} ${points[k][1]}`;
    }
    const before = points[points.length - 2];
    const label = { x: (before[0] + end[0]) / 2, y: (before[1] + end[1]) / 2 };
    return { from: blocks[e.from].id, to: blocks[e.to].id, when: e.when, d, label };
  });
  return {
    nodes: blocks.map((block, v) => ({
      id: block.id, type: block.type, x: columnX[items[v].layer], y: y[v] - top - NODE_H / 2,
    })),
    edges: placedEdges,
    width: depth ? columnX[depth - 1] + NODE_W : 0,
    height: bottom - top,
  };
}
