// PagedKV Lab: the block-table widget's view (an anywidget ES module; no build step, no CDN).
//
// The Python side (pagedkv/widgets/block_table.py) sends every frame once, already reduced to plain
// data by pagedkv/widgets/frames.py:view_frame. This file only draws a frame and runs the timer, so
// the animation never waits on the kernel. Test hooks: .pkv-root[data-frame-index], [data-testid=...],
// .pkv-play, .pkv-step-back, .pkv-step-fwd, .pkv-scrubber, .pkv-speed, .pkv-cell[data-block-id].

const SVGNS = "http://www.w3.org/2000/svg";
const ICONS = {
  back: "M11 3 L11 13 L4 8 Z M3 3 L5 3 L5 13 L3 13 Z",
  fwd: "M5 3 L5 13 L12 8 Z M11 3 L13 3 L13 13 L11 13 Z",
  play: "M4 2.5 L4 13.5 L13.5 8 Z",
  pause: "M4 3 L7 3 L7 13 L4 13 Z M9 3 L12 3 L12 13 L9 13 Z",
};
const FQ_HEAD = 30;
const FQ_TAIL = 10;

// Undo pagedkv/widgets/frames.py:encode_views: the first frame is whole, later ones carry only changes.
const DELTA_LISTS = ["ref", "hash", "owners"];
const WHEN_CHANGED = ["free", "waiting", "running", "cpu", "null", "grid", "block_size", "num_blocks"];

export function decodeFrames(encoded) {
  const out = [];
  for (const e of encoded || []) {
    if (e.full || !out.length) {
      out.push(e);
      continue;
    }
    const prev = out[out.length - 1];
    const f = {};
    for (const [k, v] of Object.entries(e)) if (!k.startsWith("d_")) f[k] = v;
    for (const key of DELTA_LISTS) {
      const d = e["d_" + key];
      if (d) {
        f[key] = prev[key].slice();
        for (const [i, v] of d) f[key][i] = v;
      } else {
        f[key] = prev[key];
      }
    }
    for (const key of WHEN_CHANGED) if (!(key in e)) f[key] = prev[key];
    if (!("tables" in e)) {
      f.tables = prev.tables.map((row) => row.slice());
      for (const [i, ...rest] of e.d_tables || []) f.tables[i] = [f.tables[i][0], ...rest];
    }
    out.push(f);
  }
  return out;
}

function h(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

function icon(name) {
  const s = document.createElementNS(SVGNS, "svg");
  s.setAttribute("viewBox", "0 0 16 16");
  s.setAttribute("width", "14");
  s.setAttribute("height", "14");
  s.setAttribute("aria-hidden", "true");
  const p = document.createElementNS(SVGNS, "path");
  p.setAttribute("d", ICONS[name]);
  p.setAttribute("fill", "currentColor");
  s.appendChild(p);
  return s;
}

function button(cls, name, label) {
  const b = h("button", "pkv-btn " + cls);
  b.type = "button";
  b.title = label;
  b.setAttribute("aria-label", label);
  b.appendChild(icon(name));
  return b;
}

function section(title, testid) {
  const s = h("div", "pkv-section");
  s.appendChild(h("div", "pkv-section-title", title));
  const body = h("div", "pkv-section-body");
  body.dataset.testid = testid;
  s.appendChild(body);
  return [s, body];
}

function render({ model, el }) {
  const root = h("div", "pkv-root");
  root.dataset.testid = "block-table-widget";
  root.tabIndex = 0;

  // Header: title, the event's kind and caption, counters.
  const header = h("div", "pkv-header");
  const titleEl = h("div", "pkv-title");
  const captionRow = h("div", "pkv-caption");
  captionRow.dataset.testid = "caption";
  const badge = h("span", "pkv-badge");
  const captionText = h("span", "pkv-caption-text");
  captionRow.append(badge, captionText);
  const stats = h("div", "pkv-stats");
  stats.dataset.testid = "stats";
  header.append(titleEl, captionRow, stats);

  // Controls.
  const controls = h("div", "pkv-controls");
  const back = button("pkv-step-back", "back", "step back");
  const play = button("pkv-play", "play", "play");
  const fwd = button("pkv-step-fwd", "fwd", "step forward");
  const scrubber = h("input", "pkv-scrubber");
  scrubber.type = "range";
  scrubber.min = "0";
  scrubber.step = "1";
  scrubber.setAttribute("aria-label", "frame");
  const frameLabel = h("span", "pkv-frame-label");
  const speed = h("select", "pkv-speed");
  speed.title = "frames per second";
  speed.setAttribute("aria-label", "speed (frames per second)");
  controls.append(back, play, fwd, scrubber, frameLabel, speed);

  // Body: the pool and its free queue on the left; tables, queues and the CPU pool on the right.
  const body = h("div", "pkv-body");
  const left = h("div", "pkv-col");
  const right = h("div", "pkv-col pkv-col-right");
  const [poolSec, pool] = section("GPU KV cache: physical blocks", "pool-grid");
  pool.classList.add("pkv-grid");
  const [fqSec, fq] = section("free queue: head (reused next) → tail (evicted last)", "free-queue");
  fq.classList.add("pkv-fq");
  const [tabSec, tables] = section("block tables: logical → physical", "block-tables");
  const [qSec, queues] = section("scheduler", "queues");
  const [cpuSec, cpuGrid] = section("CPU swap space", "cpu-pool");
  cpuGrid.classList.add("pkv-grid", "pkv-grid-cpu");
  left.append(poolSec, fqSec);
  right.append(tabSec, qSec, cpuSec);
  body.append(left, right);

  const legend = h("div", "pkv-legend");
  legend.dataset.testid = "legend";
  root.append(header, controls, body, legend);
  el.appendChild(root);

  let frames = [];
  let cur = 0;
  let timer = null;
  let cells = []; // pool cell elements, by block id
  let builtFor = -1; // num_blocks the pool cells were built for

  const colours = () => model.get("colors") || {};
  const roles = () => model.get("roles") || {};
  const colourOf = (rid) => colours()[rid] || ["#868e96", "#ffffff"];

  function paintOwners(e, owners) {
    if (owners.length === 1) {
      const [bg, fg] = colourOf(owners[0]);
      e.style.background = bg;
      e.style.color = fg;
    } else if (owners.length > 1) {
      const n = owners.length;
      const stops = owners.map((r, i) => {
        const c = colourOf(r)[0];
        return `${c} ${(100 * i) / n}% ${(100 * (i + 1)) / n}%`;
      });
      e.style.background = `linear-gradient(90deg, ${stops.join(", ")})`;
      e.style.color = "#1b1f24";
    } else {
      e.style.background = "";
      e.style.color = "";
    }
  }

  function setRole(e, role) {
    const tag = e.querySelector(":scope > .pkv-tag");
    if (role) {
      const [colour, label] = roles()[role] || ["#212529", ""];
      e.classList.add("pkv-hl");
      e.dataset.role = role;
      e.style.setProperty("--pkv-ring", colour);
      if (tag) {
        tag.textContent = label;
        tag.style.display = label ? "block" : "none";
      }
    } else {
      e.classList.remove("pkv-hl");
      delete e.dataset.role;
      if (tag) tag.style.display = "none";
    }
  }

  function buildPool(f) {
    pool.textContent = "";
    cells = [];
    const [cols, cell] = f.grid || [10, 40];
    pool.style.setProperty("--pkv-cols", cols);
    pool.style.setProperty("--pkv-cell", cell + "px");
    root.classList.toggle("pkv-small", cell < 28);
    root.classList.toggle("pkv-tiny", cell < 20);
    for (let b = 0; b < f.num_blocks; b++) {
      const c = h("div", "pkv-cell");
      c.dataset.blockId = String(b);
      c.append(h("span", "pkv-id", b), h("span", "pkv-ref"), h("span", "pkv-tag"));
      pool.appendChild(c);
      cells.push(c);
    }
    builtFor = f.num_blocks;
  }

  function drawPool(f, hl) {
    if (builtFor !== f.num_blocks) buildPool(f);
    const nulls = new Set(f.null);
    const free = new Set(f.free);
    const pos = new Map(f.free.map((b, i) => [b, i]));
    for (let b = 0; b < f.num_blocks; b++) {
      const c = cells[b];
      const owners = f.owners[b];
      const ref = f.ref[b];
      const cached = f.hash[b] !== null;
      c.className = "pkv-cell";
      if (nulls.has(b)) c.classList.add("pkv-null");
      else if (owners.length > 1) c.classList.add("pkv-shared");
      else if (owners.length === 1) c.classList.add("pkv-held");
      else if (ref > 0) c.classList.add("pkv-held", "pkv-orphan");
      else c.classList.add("pkv-free");
      if (cached) c.classList.add("pkv-cached");
      paintOwners(c, nulls.has(b) ? [] : owners);
      c.querySelector(".pkv-ref").textContent = nulls.has(b) ? "null" : ref > 0 ? String(ref) : "";
      c.dataset.refCnt = String(ref);
      c.dataset.owners = owners.join(",");
      setRole(c, hl.get(b));
      let tip = `block ${b} · ref_cnt ${ref}`;
      if (nulls.has(b)) tip = `block ${b}: the null block (never handed out)`;
      if (owners.length) tip += ` · in the table of ${owners.join(", ")}`;
      else if (ref > 0 && !nulls.has(b)) tip += " · held, not yet in a table (mid-allocation)";
      if (cached) tip += ` · cached (hash ${f.hash[b]})`;
      if (free.has(b)) tip += ` · free queue position ${pos.get(b)} of ${f.free.length}`;
      c.title = tip;
    }
  }

  function fqItem(f, b, hl) {
    const e = h("span", "pkv-fq-item", b);
    e.dataset.blockId = String(b);
    if (f.hash[b] !== null) {
      e.classList.add("pkv-cached");
      e.title = `block ${b}: cached (hash ${f.hash[b]}), evicted if reused`;
    } else {
      e.title = `block ${b}: empty`;
    }
    const role = hl.get(b);
    if (role) {
      e.classList.add("pkv-hl");
      e.style.setProperty("--pkv-ring", (roles()[role] || ["#212529"])[0]);
    }
    return e;
  }

  function drawFreeQueue(f, hl) {
    fq.textContent = "";
    const q = f.free;
    if (!q.length) {
      fq.appendChild(h("span", "pkv-muted", "(empty: every usable block is held)"));
      return;
    }
    fq.appendChild(h("span", "pkv-fq-end", "head"));
    const long = q.length > FQ_HEAD + FQ_TAIL + 1;
    const headPart = long ? q.slice(0, FQ_HEAD) : q;
    for (const b of headPart) fq.appendChild(fqItem(f, b, hl));
    if (long) {
      fq.appendChild(h("span", "pkv-fq-more", `… ${q.length - FQ_HEAD - FQ_TAIL} more …`));
      for (const b of q.slice(-FQ_TAIL)) fq.appendChild(fqItem(f, b, hl));
    }
    fq.appendChild(h("span", "pkv-fq-end", "tail"));
  }

  function chip(rid, extra) {
    const [bg, fg] = colourOf(rid);
    const e = h("span", "pkv-chip" + (extra ? " " + extra : ""), rid);
    e.style.background = bg;
    e.style.color = fg;
    e.dataset.requestId = rid;
    return e;
  }

  function drawTables(f, hl) {
    tables.textContent = "";
    if (!f.tables.length) {
      tables.appendChild(h("div", "pkv-muted", "(no request holds blocks)"));
      return;
    }
    const bs = Math.max(1, f.block_size);
    const entries = f.tables.reduce((n, row) => n + row[1].length, 0);
    tables.classList.toggle("pkv-compact", f.tables.length > 8 || entries > 96);
    const nulls = new Set(f.null);
    for (const [rid, ids, ntok, group] of f.tables) {
      const row = h("div", "pkv-table-row");
      row.dataset.requestId = rid;
      if (rid === f.request_id || rid === f.parent) row.classList.add("pkv-active");
      const label = h("div", "pkv-table-label");
      label.append(chip(rid), h("span", "pkv-ntok", ntok ? `${ntok} tok` : ""));
      if (group) label.append(h("span", "pkv-group", group));
      const slots = h("div", "pkv-slots");
      ids.forEach((b, i) => {
        const slot = h("div", "pkv-slot");
        slot.appendChild(h("span", "pkv-lidx", i));
        const p = h("div", "pkv-pblock", b);
        p.dataset.blockId = String(b);
        p.title = `${rid}: logical block ${i} → physical block ${b} (ref_cnt ${f.ref[b]})`;
        const [bg, fg] = colourOf(rid);
        p.style.background = bg;
        p.style.color = fg;
        if (nulls.has(b)) {
          // A sliding-window table's entry the window has moved past: freed, the null block in its place.
          p.classList.add("pkv-null-entry");
          p.style.background = "repeating-linear-gradient(45deg, #adb5bd 0 3px, #dee2e6 3px 6px)";
          p.style.color = "#343a40";
          p.textContent = "null";
          p.title = `${rid} (${group}): logical block ${i} is out of the window: freed, the null block in its place`;
        }
        if (f.hash[b] !== null) p.classList.add("pkv-cached");
        if (f.ref[b] > 1) {
          p.classList.add("pkv-shared-entry");
          p.appendChild(h("span", "pkv-times", "×" + f.ref[b]));
        }
        const role = hl.get(b);
        if (role) {
          p.classList.add("pkv-hl");
          p.style.setProperty("--pkv-ring", (roles()[role] || ["#212529"])[0]);
        }
        const filled = ntok ? Math.min(bs, Math.max(0, ntok - i * bs)) : 0;
        const bar = h("span", "pkv-fill");
        const inner = h("span", "pkv-fill-inner");
        inner.style.width = `${(100 * filled) / bs}%`;
        inner.style.background = bg;
        bar.appendChild(inner);
        bar.title = `${filled} of ${bs} slots filled`;
        slot.append(p, bar);
        slots.appendChild(slot);
      });
      row.append(label, slots);
      tables.appendChild(row);
    }
  }

  function drawQueues(f) {
    const has = f.running !== null || f.waiting !== null;
    qSec.style.display = has ? "" : "none";
    if (!has) return;
    queues.textContent = "";
    for (const name of ["running", "waiting"]) {
      const row = h("div", "pkv-queue-row");
      row.dataset.queue = name;
      row.appendChild(h("span", "pkv-queue-name", name));
      const list = f[name] || [];
      if (!list.length) row.appendChild(h("span", "pkv-muted", "(empty)"));
      for (const rid of list) {
        const active = rid === f.request_id ? (f.kind === "preempt" ? "pkv-preempted" : "pkv-active") : "";
        const c = chip(rid, active);
        if (f.scheduled && rid in f.scheduled) {
          c.appendChild(h("span", "pkv-sched", `+${f.scheduled[rid]}`));
          c.title = `${f.scheduled[rid]} tokens scheduled this step`;
        }
        row.appendChild(c);
      }
      queues.appendChild(row);
    }
  }

  function drawCpu(f) {
    const cpu = f.cpu;
    cpuSec.style.display = cpu ? "" : "none";
    if (!cpu) return;
    cpuSec.querySelector(".pkv-section-title").textContent =
      `CPU swap space (${cpu.free.length} of ${cpu.num_blocks} free)`;
    cpuGrid.textContent = "";
    cpuGrid.style.setProperty("--pkv-cell", "26px");
    const hl = new Map(f.cpu_hl);
    for (let b = 0; b < cpu.num_blocks; b++) {
      const c = h("div", "pkv-cell", "");
      c.dataset.blockId = String(b);
      const owners = cpu.owners[b];
      c.classList.add(owners.length ? "pkv-held" : "pkv-free");
      paintOwners(c, owners);
      c.append(h("span", "pkv-ref", b), h("span", "pkv-tag"));
      setRole(c, hl.get(b));
      c.title = `CPU block ${b}` + (owners.length ? ` · holds ${owners.join(", ")}` : " · free");
      cpuGrid.appendChild(c);
    }
  }

  function drawLegend() {
    legend.textContent = "";
    const reqs = h("div", "pkv-legend-row");
    for (const rid of model.get("request_ids") || []) reqs.appendChild(chip(rid));
    const keys = h("div", "pkv-legend-row");
    const sw = (cls, text, style) => {
      const item = h("span", "pkv-legend-item");
      const s = h("span", "pkv-swatch " + cls);
      if (style) Object.assign(s.style, style);
      item.append(s, h("span", "", text));
      keys.appendChild(item);
    };
    sw("pkv-free", "free");
    sw("pkv-free pkv-cached", "free, cached (evictable)");
    sw("pkv-held pkv-cached", "held, cached", { background: "#adb5bd" });
    sw("pkv-shared", "shared (ref_cnt > 1)", { background: "linear-gradient(90deg, #adb5bd 0 50%, #dee2e6 50% 100%)" });
    sw("pkv-null", "null block");
    const rolesRow = h("div", "pkv-legend-row");
    for (const r of model.get("legend_roles") || []) {
      const [colour, , label] = roles()[r] || ["#212529", "", r];
      if (!label) continue;
      const item = h("span", "pkv-legend-item");
      const s = h("span", "pkv-swatch pkv-free pkv-hl");
      s.style.setProperty("--pkv-ring", colour);
      item.append(s, h("span", "", label));
      rolesRow.appendChild(item);
    }
    const note = h("div", "pkv-legend-note", "big number = ref_cnt · small number = block id · bar under a table entry = its slots filled · hover a block for details");
    legend.append(reqs, keys);
    if (rolesRow.childNodes.length) legend.append(rolesRow);
    legend.append(note);
  }

  function draw(k) {
    if (!frames.length) return;
    cur = Math.max(0, Math.min(frames.length - 1, k | 0));
    const f = frames[cur];
    const hl = new Map(f.hl);
    root.dataset.frameIndex = String(cur);
    root.dataset.numFrames = String(frames.length);
    titleEl.textContent = model.get("title") || "";
    titleEl.style.display = model.get("title") ? "" : "none";
    badge.textContent = f.kind ? f.kind.replace("_", " ").toUpperCase() : "START";
    badge.style.background = f.kind_colour;
    captionText.textContent = f.caption;
    const s = f.stats;
    let where = `frame ${cur} (of 0–${frames.length - 1})`;  // numbered from 0, as recorder.frames[k]
    if (f.step !== null && f.step !== undefined) where += ` · step ${f.step}`;
    stats.textContent =
      `${where} · free ${s.free}/${s.usable} blocks · usage ${Math.round(100 * s.usage)}% · ` +
      `cached ${s.cached} (${s.cached_free} evictable) · block_size ${f.block_size}`;
    scrubber.max = String(frames.length - 1);
    scrubber.value = String(cur);
    frameLabel.textContent = `${cur} of 0–${frames.length - 1}`;
    back.disabled = cur === 0;
    fwd.disabled = cur === frames.length - 1;
    drawPool(f, hl);
    drawFreeQueue(f, hl);
    drawTables(f, hl);
    drawQueues(f);
    drawCpu(f);
  }

  function save(k) {
    try {
      if (model.get("frame") !== k) {
        model.set("frame", k);
        model.save_changes();
      }
    } catch (err) {
      // No kernel (a restored notebook): the view still animates on its own.
    }
  }

  function go(k) {
    draw(k);
    save(cur);
  }

  function setPlayIcon(playing) {
    play.textContent = "";
    play.appendChild(icon(playing ? "pause" : "play"));
    play.title = playing ? "pause" : "play";
    play.setAttribute("aria-label", play.title);
    play.classList.toggle("pkv-playing", playing);
    root.dataset.playing = playing ? "true" : "false";
  }

  function tick() {
    if (cur >= frames.length - 1) {
      if (model.get("loop")) go(0);
      else pause();
      return;
    }
    go(cur + 1);
  }

  function start() {
    clearInterval(timer);
    timer = setInterval(tick, 1000 / Math.max(0.1, model.get("fps") || 2));
  }

  function playNow() {
    if (frames.length < 2) return;
    if (cur >= frames.length - 1) go(0);
    setPlayIcon(true);
    start();
  }

  function pause() {
    clearInterval(timer);
    timer = null;
    setPlayIcon(false);
  }

  function fillSpeeds() {
    speed.textContent = "";
    const fps = model.get("fps");
    const options = [...(model.get("speeds") || [0.5, 1, 2, 4, 8])];
    if (!options.includes(fps)) options.push(fps);
    options.sort((a, b) => a - b);
    for (const v of options) {
      const o = h("option", "", `${v} fps`);
      o.value = String(v);
      if (v === fps) o.selected = true;
      speed.appendChild(o);
    }
  }

  function load() {
    frames = decodeFrames(model.get("frames"));
    builtFor = -1;
    drawLegend();
    fillSpeeds();
    draw(model.get("frame") || 0);
  }

  play.addEventListener("click", () => (timer ? pause() : playNow()));
  back.addEventListener("click", () => {
    pause();
    go(cur - 1);
  });
  fwd.addEventListener("click", () => {
    pause();
    go(cur + 1);
  });
  scrubber.addEventListener("input", () => {
    pause();
    go(Number(scrubber.value));
  });
  speed.addEventListener("change", () => {
    try {
      model.set("fps", Number(speed.value));
      model.save_changes();
    } catch (err) {
      // no kernel
    }
    if (timer) start();
  });
  root.addEventListener("keydown", (ev) => {
    const keys = { ArrowLeft: () => (pause(), go(cur - 1)), ArrowRight: () => (pause(), go(cur + 1)), " ": () => (timer ? pause() : playNow()) };
    const fn = keys[ev.key];
    if (fn && ev.target === root) {
      ev.preventDefault();
      ev.stopPropagation();
      fn();
    }
  });

  const onFrame = () => {
    const k = model.get("frame");
    if (k !== cur) draw(k);
  };
  const onFps = () => {
    fillSpeeds();
    if (timer) start();
  };
  model.on("change:frame", onFrame);
  model.on("change:frames", load);
  model.on("change:fps", onFps);
  model.on("change:title", () => draw(cur));
  model.on("change:colors", load);

  setPlayIcon(false);
  load();

  return () => {
    clearInterval(timer);
    model.off("change:frame", onFrame);
    model.off("change:frames", load);
    model.off("change:fps", onFps);
    model.off("change:colors", load);
  };
}

export default { render };
