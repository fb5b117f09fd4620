// The timeline: for a window and a resource prefix (or an agent), one lane per resource and a bar per
// lease, coloured by holder, with marks where a lease ended badly (expired by the reaper, lapsed with
// nothing recorded yet, force-released) and the slider's instant as a line. Clicking a bar lists that
// lease's events. Data: /v1/replay/state at the window's start (the leases already live) and
// /v1/replay/changes over the window, up to MAX_PAGES pages.

const PAGE = 1000;
const MAX_PAGES = 5;
const MAX_LANES = 40;
const LABEL_W = 220; // the lanes' names, in pixels
const LABEL_CHARS = 28;
const LANE_H = 22;
const AXIS_H = 20;
const SVG = "http://www.w3.org/2000/svg";
// How a lease ended: each change type that ends one, and whether it gets a mark.
const ENDINGS = {
  LOCK_RELEASED: "released",
  LOCK_EXPIRED: "expired",
  LEASE_LAPSED: "lapsed",
  LOCK_FORCE_RELEASED: "force-released",
};
const MARKED = new Set(["expired", "lapsed", "force-released"]);
// The changes that begin a lease: an acquire, or a hand-off, which also ends the giver's ("handed-off").
const STARTS = new Set(["LOCK_ACQUIRED", "LOCK_HANDED_OFF"]);

// Leases by resource from the leases live at `from` and the changes after it, in time order; a lease
// still held at `to` ends there ("held"). Mutex leases only: a shared lock's grants (a `mode` in the
// state, a `shared/` stream in the changes) are several at once, which one row per resource cannot show.
export function leasesOf(liveAtStart, allChanges, from, to) {
  const changes = allChanges.filter((change) => !change.resource.startsWith("shared/"));
  liveAtStart = liveAtStart.filter((live) => live.mode == null);
  const open = new Map();
  const leases = [];
  const begin = (resource, owner, token, at, events) => {
    const lease = { resource, owner, token, start: at, end: to, ending: "held", events };
    open.set(resource, lease);
    leases.push(lease);
    return lease;
  };
  for (const live of liveAtStart) begin(live.resource, live.owner, live.fencing_token, from, []);
  for (const change of changes) {
    const at = Date.parse(change.at);
    let lease = open.get(change.resource);
    const starts = STARTS.has(change.type);
    if (starts || !lease) {
      if (lease) [lease.end, lease.ending] = [at, change.type === "LOCK_HANDED_OFF" ? "handed-off" : "replaced"];
      lease = begin(change.resource, change.owner, change.fencing_token, starts ? at : from, []);
    }
    lease.events.push(change);
    const ending = ENDINGS[change.type];
    if (ending) {
      [lease.end, lease.ending] = [at, ending];
      open.delete(change.resource);
    }
  }
  return leases;
}

// A holder's colour: the same for the same name on every draw, and far apart for names one character
// apart (agv-1, agv-2): FNV-1a spreads a last character's difference over the hue.
function colourOf(owner) {
  let hash = 2166136261;
  for (const char of owner ?? "") hash = Math.imul(hash ^ char.codePointAt(0), 16777619) >>> 0;
  return `hsl(${hash % 360} 62% 48%)`;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
  return node;
}

function clock(ms) {
  return new Date(ms).toISOString().slice(11, 19);
}

export function setUpTimeline({ api, now, instant, el }) {
  const $ = (id) => document.getElementById(id);
  let shown = null; // {from, to, leases}

  async function changesOver(from, to, filter) {
    const changes = [];
    let cursor = null;
    for (let page = 0; page < MAX_PAGES; page++) {
      const params = new URLSearchParams({ from: new Date(from).toISOString(), to: new Date(to).toISOString(), limit: PAGE, ...filter });
      if (cursor) params.set("cursor", cursor);
      const answer = await api(`/v1/replay/changes?${params}`);
      changes.push(...answer.changes);
      cursor = answer.next_cursor;
      if (!cursor) return { changes, cut: false };
    }
    return { changes, cut: true };
  }

  async function show(event) {
    event?.preventDefault();
    const prefix = $("tl-prefix").value.trim();
    const agent = $("tl-agent").value.trim();
    const filter = agent ? { owner: agent } : prefix ? { prefix } : {};
    const to = Math.min(instant() ?? now(), now() - 1000);
    const from = to - Number($("tl-window").value);
    $("tl-status").textContent = "loading…";
    const params = new URLSearchParams({ at: new Date(from).toISOString(), limit: 10000, ...filter });
    const [live, { changes, cut }] = await Promise.all([api(`/v1/replay/state?${params}`), changesOver(from, to, filter)]);
    shown = { from, to, leases: leasesOf(live.locks, changes, from, to), cut };
    draw();
  }

  function draw() {
    const chart = $("tl-chart");
    const { from, to, leases, cut } = shown;
    const resources = [...new Set(leases.map((lease) => lease.resource))].sort();
    const lanes = resources.slice(0, MAX_LANES);
    const width = chart.clientWidth || 1000; // one unit a pixel: text keeps its size at any width
    const x = (ms) => LABEL_W + ((ms - from) / (to - from)) * (width - LABEL_W);
    const height = AXIS_H + lanes.length * LANE_H;
    chart.setAttribute("viewBox", `0 0 ${width} ${height}`);
    chart.style.height = `${height}px`;
    const nodes = [];
    for (const [i, tick] of [from, (from + to) / 2, to].entries()) {
      const anchor = ["start", "middle", "end"][i];
      nodes.push(svg("text", { x: x(tick), y: 14, class: "axis", "text-anchor": anchor }));
      nodes.at(-1).textContent = `${clock(tick)} UTC`;
    }
    lanes.forEach((resource, lane) => {
      const y = AXIS_H + lane * LANE_H;
      // The name in full on hover; cut to what the label column holds.
      const label = svg("g");
      const name = svg("text", { x: 4, y: y + 15, class: "lane", "data-resource": resource });
      name.textContent = resource.length > LABEL_CHARS ? `${resource.slice(0, LABEL_CHARS - 1)}…` : resource;
      label.append(Object.assign(svg("title"), { textContent: resource }), name);
      nodes.push(svg("line", { x1: LABEL_W, x2: width, y1: y + LANE_H - 1, y2: y + LANE_H - 1, class: "lane-rule" }), label);
      for (const lease of leases.filter((each) => each.resource === resource)) {
        const left = x(lease.start);
        const bar = svg("rect", {
          x: left, y: y + 3, width: Math.max(2, x(lease.end) - left), height: LANE_H - 7, rx: 3,
          fill: colourOf(lease.owner), class: "lease", tabindex: 0,
          "data-resource": resource, "data-owner": lease.owner ?? "", "data-token": lease.token ?? "", "data-end": lease.ending,
        });
        bar.append(Object.assign(svg("title"), { textContent: `${lease.owner} · #${lease.token} · ${lease.ending}` }));
        bar.addEventListener("click", () => details(lease));
        bar.addEventListener("keydown", (key) => key.key === "Enter" && details(lease));
        nodes.push(bar);
        if (MARKED.has(lease.ending)) {
          const mx = x(lease.end);
          const mark = svg("path", { d: `M${mx - 5} ${y + 1} L${mx + 5} ${y + 1} L${mx} ${y + 9} Z`, class: "mark", "data-kind": lease.ending });
          mark.append(Object.assign(svg("title"), { textContent: `${lease.ending} at ${clock(lease.end)} UTC` }));
          nodes.push(mark);
        }
      }
    });
    const at = instant();
    if (at !== null && at >= from && at <= to) {
      nodes.push(svg("line", { x1: x(at), x2: x(at), y1: AXIS_H - 2, y2: height, class: "instant" }));
    }
    chart.replaceChildren(...nodes);
    const notes = [`${leases.length} leases on ${resources.length} resources`];
    if (resources.length > MAX_LANES) notes.push(`the first ${MAX_LANES} resources shown`);
    if (cut) notes.push(`the first ${(PAGE * MAX_PAGES).toLocaleString("en")} changes`);
    $("tl-status").textContent = notes.join(" · ");
    $("tl-details").replaceChildren();
  }

  function details(lease) {
    $("tl-details").replaceChildren(
      el("li", { class: "marker", text: `${lease.resource}: ${lease.owner} · #${lease.token} · ${lease.ending}` }),
      ...lease.events.map((change) =>
        el("li", {}, el("time", { text: `${clock(Date.parse(change.at))} UTC` }), el("span", { class: "type", text: change.type }), el("span", { class: "mono", text: change.fencing_token == null ? "" : `#${change.fencing_token}` })),
      ),
    );
  }

  $("tl-form").addEventListener("submit", (event) => show(event).catch((error) => {
    $("tl-status").textContent = "could not load";
    console.warn(error);
  }));
  // The slider moved: the instant's line moves with it (the window stays until shown again). Called on
  // every render; redraws only when the instant changed.
  let drawnAt = null;
  return {
    instantMoved: () => {
      const at = instant();
      if (shown && at !== drawnAt) draw();
      drawnAt = at;
    },
  };
}
