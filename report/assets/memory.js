(() => {  // one scope: no global of the page's (window.top) is shadowed
const fmtBytes = (b) => {
  const u = ['B', 'KiB', 'MiB', 'GiB', 'TiB']; let i = 0; let v = b;
  while (Math.abs(v) >= 1024 && i < u.length - 1) { v /= 1024; ++i; }
  return (i === 0 ? v.toFixed(0) : v.toFixed(1)) + ' ' + u[i];
};
const el = (id) => document.getElementById(id);
const colors = { parameter: '#4e79a7', gradient: '#f28e2b', optimizer_state: '#e15759', activation: '#76b7b2',
                 workspace: '#59a14f', input: '#edc948', temporary: '#b07aa1' };
const D = DATA;
const E = D.events;                      // number of trace events
const N = D.allocs.length / 8;           // allocations of the trace
const A = (i, k) => D.allocs[8 * i + k]; // 0 alloc event, 1 free event (-1: live at the end), 2 rounded,
                                         // 3 requested, 4 category, 5 module, 6 op, 7 phase
// Running total after each event, from the state live before the trace.
const base0 = D.base.reduce((a, b) => a + b, 0);
const delta = new Float64Array(E);
for (let i = 0; i < N; ++i) { delta[A(i, 0)] += A(i, 2); if (A(i, 1) >= 0) delta[A(i, 1)] -= A(i, 2); }
for (const [e, c, bytes] of D.baseFrees) delta[e] -= bytes;
const total = new Float64Array(E + 1);
total[0] = base0;  // total[e + 1]: after event e
for (let e = 0; e < E; ++e) total[e + 1] = total[e] + delta[e];
let peak = base0, peakAt = -1;
for (let e = 0; e < E; ++e) if (total[e + 1] > peak) { peak = total[e + 1]; peakAt = e; }

// The micro-batch (the last mark before an event).
const markBefore = (e) => { let m = null; for (const [at, label] of D.marks) if (at <= e) m = label; return m; };

// ---- the timeline ---------------------------------------------------------------------------
const canvas = el('chart'), ctx = canvas.getContext('2d');
const W = canvas.width, H = canvas.height, left = 70, top = 10, bottom = 28, plotW = W - left - 10, plotH = H - top - bottom;
let view = { e0: 0, e1: E };   // events shown
let columns = [];              // per pixel column: { e, ids: [...], y0: [...], base: [...] }
let selected = -1;
const ymax = Math.max(peak, D.budget) * 1.05;
const yOf = (bytes) => top + plotH - (bytes / ymax) * plotH;
function layout() {
  columns = [];
  const live = [];  // allocation ids, in allocation order
  const liveBase = D.base.slice();
  const byEvent = new Map();  // event -> [allocated id] or [freed id]
  for (let i = 0; i < N; ++i) {
    byEvent.set(A(i, 0), { alloc: i });
    if (A(i, 1) >= 0) byEvent.set(A(i, 1), { free: i });
  }
  const baseFreeAt = new Map(D.baseFrees.map(([e, c, b]) => [e, [c, b]]));
  const span = Math.max(1, view.e1 - view.e0);
  let e = 0;
  for (let c = 0; c < plotW; ++c) {
    // The column shows the state after the event of highest total inside it (never averaging the peak away).
    const from = view.e0 + Math.floor(c * span / plotW), to = Math.max(from + 1, view.e0 + Math.floor((c + 1) * span / plotW));
    let show = Math.min(to, E) - 1, best = -1;
    for (let k = from; k < Math.min(to, E); ++k) if (total[k + 1] > best) { best = total[k + 1]; show = k; }
    for (; e <= show && e < E; ++e) {
      const ev = byEvent.get(e);
      if (ev && ev.alloc !== undefined) live.push(ev.alloc);
      else if (ev && ev.free !== undefined) { const at = live.indexOf(ev.free); if (at >= 0) live.splice(at, 1); }
      const bf = baseFreeAt.get(e); if (bf) liveBase[bf[0]] -= bf[1];
    }
    const col = { e: show, ids: live.slice(), y0: new Float64Array(live.length), base: liveBase.slice() };
    let y = liveBase.reduce((a, b) => a + b, 0);
    for (let k = 0; k < live.length; ++k) { col.y0[k] = y; y += A(live[k], 2); }
    columns.push(col);
  }
}
function shade(hex, i) {  // the category's colour, a little lighter or darker per allocation
  const f = 0.82 + 0.36 * (((i * 2654435761) >>> 0) % 97) / 97;
  const n = parseInt(hex.slice(1), 16);
  const ch = (s) => Math.max(0, Math.min(255, Math.round(((n >> s) & 255) * f)));
  return `rgb(${ch(16)},${ch(8)},${ch(0)})`;
}
function draw() {
  ctx.fillStyle = 'white'; ctx.fillRect(0, 0, W, H);
  // The state live before the trace: one band per category.
  for (let c = 0; c < columns.length; ++c) {
    let y = 0;
    for (let k = 0; k < D.base.length; ++k) {
      const b = columns[c].base[k]; if (b <= 0) continue;
      ctx.fillStyle = colors[D.categories[k]]; ctx.globalAlpha = 0.55;
      ctx.fillRect(left + c, yOf(y + b), 1, yOf(y) - yOf(y + b)); y += b;
    }
  }
  ctx.globalAlpha = 1;
  // Each allocation, column by column.
  for (let c = 0; c < columns.length; ++c) {
    const col = columns[c];
    for (let k = 0; k < col.ids.length; ++k) {
      const i = col.ids[k], y0 = col.y0[k], y1 = y0 + A(i, 2);
      ctx.fillStyle = i === selected ? '#000' : shade(colors[D.categories[A(i, 4)]], i);
      ctx.fillRect(left + c, yOf(y1), 1, Math.max(0.5, yOf(y0) - yOf(y1)));
    }
  }
  // Axes, budget, marks.
  ctx.strokeStyle = '#888'; ctx.fillStyle = '#333'; ctx.font = '11px Helvetica, Arial';
  ctx.beginPath(); ctx.moveTo(left, top); ctx.lineTo(left, top + plotH); ctx.lineTo(left + plotW, top + plotH); ctx.stroke();
  for (let t = 0; t <= 4; ++t) { const b = ymax * t / 4; ctx.fillText(fmtBytes(b), 4, yOf(b) + 4); }
  ctx.strokeStyle = '#d00'; ctx.beginPath(); ctx.moveTo(left, yOf(D.budget)); ctx.lineTo(left + plotW, yOf(D.budget)); ctx.stroke();
  ctx.fillStyle = '#d00'; ctx.fillText('budget ' + fmtBytes(D.budget), left + plotW - 130, yOf(D.budget) - 4);
  ctx.strokeStyle = '#555'; ctx.fillStyle = '#555';
  const span = Math.max(1, view.e1 - view.e0);
  let lastLabel = -1e9;
  for (const [at, label] of D.marks) {
    if (at < view.e0 || at > view.e1) continue;
    const x = left + (at - view.e0) / span * plotW;
    ctx.setLineDash([3, 3]); ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, top + plotH); ctx.stroke(); ctx.setLineDash([]);
    // "micro-batch 3/20 (13 samples)" is labelled "3/20" where there is room; the rest as they are.
    const short = label.startsWith('micro-batch ') ? label.replace(/^micro-batch (\S+).*/, '$1') : label;
    if (x - lastLabel > 8 * short.length) { ctx.fillText(short, x + 2, top + plotH + 14); lastLabel = x; }
  }
}
function at(x, y) {  // the allocation under a point, or -1
  const c = Math.floor(x - left); if (c < 0 || c >= columns.length) return -1;
  const col = columns[c];
  const bytes = (top + plotH - y) / plotH * ymax;
  for (let k = 0; k < col.ids.length; ++k) if (bytes >= col.y0[k] && bytes < col.y0[k] + A(col.ids[k], 2)) return col.ids[k];
  return -1;
}
function describe(i) {
  if (i < 0) return 'hover a band';
  const f = A(i, 1);
  return [`module    ${D.modules[A(i, 5)] || '(none: inputs, the loss, the optimizer step)'}`,
          `op        ${D.ops[A(i, 6)]}   phase ${D.phases[A(i, 7)]}   category ${D.categories[A(i, 4)]}`,
          `bytes     ${A(i, 3)} requested, ${A(i, 2)} taken from the budget (${fmtBytes(A(i, 2))})`,
          `allocated event ${A(i, 0)} (${(D.t[A(i, 0)] / 1000).toFixed(3)} ms)   freed ${f >= 0 ? `event ${f} (${(D.t[f] / 1000).toFixed(3)} ms)` : 'after the trace'}`,
          `during    ${markBefore(A(i, 0)) || 'before the first mark'}`].join('\n');
}
canvas.addEventListener('mousemove', (ev) => { if (selected < 0) el('details').textContent = describe(at(ev.offsetX, ev.offsetY)); });
canvas.addEventListener('click', (ev) => { const i = at(ev.offsetX, ev.offsetY); select(i); });
function select(i) { selected = i; el('details').textContent = describe(i); el('details').dataset.selected = i; draw(); }

// ---- zoom buttons: the whole step, or one span between marks -----------------------------------
function zoomButtons() {
  const z = el('zoom'); z.innerHTML = '';
  const add = (label, e0, e1) => { const b = document.createElement('button'); b.textContent = label;
    b.onclick = () => { view = { e0, e1 }; layout(); draw(); }; z.appendChild(b); };
  add('whole step', 0, E);
  D.marks.forEach(([atEvent, label], k) => add(label.replace(/ \(.*\)/, ''), atEvent,
                                               k + 1 < D.marks.length ? D.marks[k + 1][0] : E));
}

// ---- the peak, explained ----------------------------------------------------------------------
function peakTables() {
  const byCat = new Map(), byModule = new Map();
  const add = (m, k, b) => m.set(k, (m.get(k) || 0) + b);
  const liveBase = D.base.slice();
  for (const [e, c, b] of D.baseFrees) if (e <= peakAt) liveBase[c] -= b;
  liveBase.forEach((b, c) => { if (b > 0) { add(byCat, D.categories[c], b); add(byModule, '(before the step) ' + D.categories[c], b); } });
  for (let i = 0; i < N; ++i) {
    if (A(i, 0) > peakAt || (A(i, 1) >= 0 && A(i, 1) <= peakAt)) continue;
    add(byCat, D.categories[A(i, 4)], A(i, 2));
    add(byModule, (D.modules[A(i, 5)] || '(no module)') + ' ' + D.phases[A(i, 7)], A(i, 2));
  }
  const fill = (table, m, what) => {
    const rows = [...m.entries()].sort((a, b) => b[1] - a[1]);
    let sum = 0; rows.forEach(r => sum += r[1]);
    table.innerHTML = `<tr><th>${what}</th><th>bytes</th><th></th></tr>` +
      rows.map(([k, b]) => `<tr><td>${k}</td><td>${b}</td><td>${fmtBytes(b)}</td></tr>`).join('') +
      `<tr><td><b>total</b></td><td class="sum"><b>${sum}</b></td><td>${fmtBytes(sum)}</td></tr>`;
    table.dataset.sum = sum;
  };
  fill(el('peak-categories'), byCat, 'category');
  fill(el('peak-modules'), byModule, 'module and phase');
}

// ---- the plan and the per-layer table -----------------------------------------------------------
const layerColumns = [
  ['layer', 'the module, by its dotted name (as its parameters are named); indented by depth'],
  ['type', 'its class'],
  ['output', 'its output shape for one sample'],
  ['parameters', 'elements of its own parameters (its children have theirs)'],
  ['kept per sample', 'activation bytes still held, per sample, when the call returns — its output and what it saved for the backward — less what its children\'s rows already count. A container\'s row holds only what its own code changed beyond its children: it is negative when the container released more than it kept (its children\'s outputs it consumed and freed, e.g. a bottleneck\'s intermediate tensors once its add has run).'],
  ['workspace', 'the largest scratch space a kernel of the call took (convolution algorithms), for the whole batch'],
];
function planTables() {
  el('plan').innerHTML = D.plan.map(([k, v]) => `<tr><td>${k}</td><td style="text-align:left">${v}</td></tr>`).join('');
  if (!D.layers.length) return;
  const s = el('layers-section');
  s.innerHTML = `<h2>Per layer (one forward, training mode, at ${D.layerBatch} samples)</h2>` +
    '<dl>' + layerColumns.map(([c, what]) => `<dt>${c}</dt><dd>${what}</dd>`).join('') + '</dl><table id="layers"></table>';
  let rows = D.layers.map((r, k) => ({ k, r }));
  let by = -1, asc = true;
  const render = () => {
    const t = el('layers');
    t.innerHTML = '<tr>' + layerColumns.map(([c, what], j) => `<th title="${what.replace(/"/g, '&quot;')}" data-col="${j}">${c}${by === j ? (asc ? ' &#9650;' : ' &#9660;') : ''}</th>`).join('') + '</tr>' +
      rows.map(({ r }) => `<tr><td>${'&nbsp;&nbsp;'.repeat(r[2])}${r[0]}</td><td>${r[1]}</td><td>${r[3]}</td><td>${r[4]}</td><td>${fmtBytes(r[5])}</td><td>${r[6] ? fmtBytes(r[6]) : '-'}</td></tr>`).join('');
    t.querySelectorAll('th').forEach(th => th.onclick = () => {
      const j = +th.dataset.col; asc = by === j ? !asc : false; by = j;
      const key = [0, 1, 3, 4, 5, 6][j];
      rows.sort((a, b) => { const x = a.r[key], y = b.r[key]; const o = typeof x === 'number' ? x - y : String(x).localeCompare(String(y)); return (asc ? o : -o) || a.k - b.k; });
      render();
    });
  };
  render();
}

// ---- the page ---------------------------------------------------------------------------------
el('title').textContent = D.title;
el('source').textContent = D.source + ` — ${N} allocations, ${E} events` +
  '; the state live before it (parameters, gradients, optimizer state) is drawn one band per category.';
el('legend').innerHTML = D.categories.map(c => `<span><i style="background:${colors[c]}"></i>${c}</span>`).join('');
el('peak-bytes').textContent = peak;
el('peak-human').textContent = fmtBytes(peak);
el('peak-event').textContent = peakAt;
el('trace-peak').textContent = D.tracePeak;
if (D.predicted !== null) el('predicted').innerHTML = `&middot; the plan's prediction: <span id="predicted-peak">${D.predicted}</span> bytes`;
const mbMarks = D.marks.filter(([a, l]) => l.startsWith('micro-batch')).length;
el('source').insertAdjacentHTML('beforeend', ` <span id="micro-batch-count" data-count="${mbMarks}">${mbMarks} micro-batches traced</span> of the step's ${D.microBatches}.`);
layout(); draw(); zoomButtons(); peakTables(); planTables();
const wanted = decodeURIComponent((location.hash.match(/select=([^&]*)/) || [])[1] || '');
if (wanted) { for (let i = 0; i < N; ++i) if (D.modules[A(i, 5)] === wanted) { select(i); break; } }
document.body.dataset.ready = 'yes';
document.body.dataset.drawMs = Math.round(performance.now());  // from navigation start: parse, layout, draw
})();
