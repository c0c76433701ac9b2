// The layered layout of a workflow for graph.js: where each block's node goes and the
// path of each edge, left to right by dependency. Pure: no DOM, only numbers.
//
// The classic steps for a DAG (Sugiyama's), each in its simplest form that is good enough
// for a workflow of at most 500 blocks and 2,000 edges (SPEC §8), laid out in about
// 50 ms: longest-path layers, with each block then moved as late as its dependents
// allow; long edges broken by virtual items, one per layer crossed (within a budget);
// barycentric ordering sweeps, keeping the order with the fewest crossings; rows by
// isotonic regression (pool-adjacent-violators) towards each item's neighbours.
// layoutWorkflow runs those steps in order; each is a function of its own below.

export const LAYOUT = Object.freeze({
  NODE_W: 176,
  NODE_H: 46,
  ROW_GAP: 16,
  LAYER_GAP: 56,
  LABEL_CHARS: 34, // a longer condition is cut short (the tooltip has all of it)
  CHAR_W: 6.7, // an 11px monospace character, for the label's box
  DUMMY_BUDGET: 6000, // virtual items for long edges; past it, an edge goes straight
});

export function cutText(text, max) {
  return text.length > max ? `${text.slice(0, max - 1)}…` : text;
}

/**
 * Positions for a workflow's blocks and paths for its edges, left to right by layer.
 * Returns {nodes: [{id, type, x, y}], edges: [{from, to, when, d, label: {x, y}}], width, height}.
 */
export function layoutWorkflow(workflow) {
  const { NODE_W, NODE_H } = LAYOUT;
  const graph = graphOf(workflow);
  const { blocks, edges } = graph;
  const order = topologicalOrder(graph);
  const layerOf = assignLayers(graph, order);
  const items = withVirtualItems(graph, layerOf);
  const depth = blocks.length ? Math.max(...layerOf) + 1 : 0;
  const layers = orderLayers(groupLayers(items, order, blocks.length, depth), items);
  const y = assignRows(layers, items);
  const { top, bottom } = extent(items, y);
  const columnX = columns(edges, items, depth);
  const ports = portOffsets(graph, y);
  const at = (v) => [columnX[items[v].layer], y[v] - top];
  return {
    nodes: blocks.map((block, v) => ({
      id: block.id, type: block.type, x: columnX[items[v].layer], y: y[v] - top - NODE_H / 2,
    })),
    edges: edges.map((e) => edgePath(e, at, ports, blocks)),
    width: depth ? columnX[depth - 1] + NODE_W : 0,
    height: bottom - top,
  };
}

// The blocks by index, the edges between known blocks, and each block's neighbours.
function graphOf(workflow) {
  const blocks = workflow.blocks || [];
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
  return { blocks, n: blocks.length, edges, succ, pred };
}

// Topological order, workflow order among the ready (the server refused cycles;
// anything left over is appended so a bad definition still draws).
function topologicalOrder({ n, succ, pred }) {
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
  return order;
}

// Longest-path layers, then each block with dependents as late as they allow: a
// source that only the last block reads sits beside it, not a whole row away.
function assignLayers({ n, succ }, order) {
  const layerOf = new Array(n).fill(0);
  for (const v of order) for (const s of succ[v]) layerOf[s] = Math.max(layerOf[s], layerOf[v] + 1);
  for (let i = order.length - 1; i >= 0; i -= 1) {
    const v = order[i];
    if (succ[v].length === 0) continue;
    const latest = Math.min(...succ[v].map((s) => layerOf[s])) - 1;
    if (latest > layerOf[v]) layerOf[v] = latest;
  }
  return layerOf;
}

// Items: the blocks, then one virtual item per layer crossed by a long edge. Each edge
// gets its `chain` of items, from its source to its target.
function withVirtualItems({ blocks, edges }, layerOf) {
  const items = blocks.map((_, i) => ({ layer: layerOf[i], real: true, up: [], down: [] }));
  let budget = LAYOUT.DUMMY_BUDGET;
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
  return items;
}

// The items of each layer: blocks in topological order, then the virtual items.
function groupLayers(items, order, n, depth) {
  const layers = Array.from({ length: depth }, () => []);
  for (const v of order) layers[items[v].layer].push(v);
  for (let v = n; v < items.length; v += 1) layers[items[v].layer].push(v);
  return layers;
}

// Barycentric sweeps, down then up, keeping the order with the fewest crossings.
function orderLayers(layers, items) {
  const depth = layers.length;
  const pos = new Array(items.length);
  const number = (layer) => layer.forEach((v, i) => { pos[v] = i; });
  layers.forEach(number);
  const sweep = (l, side) => {
    const key = new Map();
    for (const v of layers[l]) {
      const near = items[v][side];
      key.set(v, near.length ? near.reduce((sum, u) => sum + pos[u], 0) / near.length : pos[v]);
    }
    layers[l].sort((a, b) => key.get(a) - key.get(b) || pos[a] - pos[b]);
    number(layers[l]);
  };
  let best = layers.map((layer) => layer.slice());
  let fewest = crossings(layers, items, pos);
  for (let round = 0; round < 12 && fewest > 0; round += 1) {
    if (round % 2 === 0) for (let l = 1; l < depth; l += 1) sweep(l, "up");
    else for (let l = depth - 2; l >= 0; l -= 1) sweep(l, "down");
    const now = crossings(layers, items, pos);
    if (now < fewest) {
      fewest = now;
      best = layers.map((layer) => layer.slice());
    }
  }
  return best;
}

// The edge crossings between neighbouring layers, given each item's position in its layer.
function crossings(layers, items, pos) {
  let total = 0;
  for (let l = 0; l + 1 < layers.length; l += 1) {
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
}

const itemHeight = (items, v) => (items[v].real ? LAYOUT.NODE_H : 0);

const itemGap = (items, a, b) =>
  items[a].real && items[b].real ? LAYOUT.ROW_GAP : items[a].real || items[b].real ? 10 : 6;

// Each item's minimum offset from the first of its layer, for the order and spacing.
function offsetsIn(layer, items) {
  const offsets = [];
  let at = 0;
  layer.forEach((v, i) => {
    if (i > 0) at += (itemHeight(items, layer[i - 1]) + itemHeight(items, v)) / 2 + itemGap(items, layer[i - 1], v);
    offsets.push(at);
  });
  return offsets;
}

// Rows: each item as near its neighbours' mean as the order and spacing allow.
function assignRows(layers, items) {
  const y = new Array(items.length);
  for (const layer of layers) {
    offsetsIn(layer, items).forEach((at, i) => { y[layer[i]] = at; });
  }
  const passes = [["up"], ["down"], ["up"], ["down"], ["up", "down"], ["up", "down"]];
  for (const sides of passes) {
    const range = sides[0] === "down" ? [...layers.keys()].reverse() : [...layers.keys()];
    for (const l of range) placeLayer(layers[l], sides, items, y);
  }
  return y;
}

// One layer's rows by pool-adjacent-violators on y minus each item's minimum offset.
function placeLayer(layer, sides, items, y) {
  const offsets = offsetsIn(layer, items);
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
}

// The top and bottom of the drawing's rows.
function extent(items, y) {
  let top = Infinity;
  let bottom = -Infinity;
  for (let v = 0; v < items.length; v += 1) {
    top = Math.min(top, y[v] - itemHeight(items, v) / 2);
    bottom = Math.max(bottom, y[v] + itemHeight(items, v) / 2);
  }
  if (!items.length) top = bottom = 0;
  return { top, bottom };
}

// Columns: the gap before a layer is wide enough for the conditions that enter it.
function columns(edges, items, depth) {
  const { NODE_W, LAYER_GAP, LABEL_CHARS, CHAR_W } = LAYOUT;
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
  return columnX;
}

// Ports: a block's edges leave and arrive spread along its side, in row order.
function portOffsets({ n, blocks, edges }, y) {
  const spread = (list, rowOf) => {
    const sorted = list.slice().sort((a, b) => rowOf(a) - rowOf(b));
    const step = Math.min(8, (LAYOUT.NODE_H - 16) / Math.max(1, sorted.length - 1));
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
  return { outPort, inPort };
}

const curve = (a, b) => {
  const mid = (a[0] + b[0]) / 2;
  return `C${mid} ${a[1]} ${mid} ${b[1]} ${b[0]} ${b[1]}`;
};

// An edge's path through its chain of items, given `at(v)`: an item's column and row.
function edgePath(e, at, { outPort, inPort }, blocks) {
  const { NODE_W } = LAYOUT;
  const [fromX, fromY] = at(e.from);
  const points = [[fromX + NODE_W, fromY + outPort.get(e)]];
  for (const v of e.chain.slice(1, -1)) {
    const [cx, cy] = at(v);
    points.push([cx, cy], [cx + NODE_W, cy]);
  }
  const [toX, toY] = at(e.to);
  const end = [toX - 1, toY + inPort.get(e)];
  points.push(end);
  let d = `M${points[0][0]} ${points[0][1]}`;
  for (let k = 1; k < points.length; k += 1) {
    // Between columns a curve; across a column a virtual item's straight run.
    d += k % 2 === 1 ? curve(points[k - 1], points[k]) : `L${points[k][0]} ${points[k][1]}`;
  }
  const before = points[points.length - 2];
  const label = { x: (before[0] + end[0]) / 2, y: (before[1] + end[1]) / 2 };
  return { from: blocks[e.from].id, to: blocks[e.to].id, when: e.when, d, label };
}
