// The pyhf-gpu web page: upload a workspace (and a patchset), start a job, watch its progress
// (server-sent events read with fetch, so that the Bearer header goes along), then show its
// plots and a results table. Plain JavaScript, no dependencies; served by the service itself.
"use strict";

(() => {
  const AUTH = document.body.dataset.auth === "on";
  const MODE = document.body.dataset.mode || "index";
  const TOKEN_KEY = "pyhf-gpu-token";
  const RECENT_KEY = "pyhf-gpu-workspaces";
  const PLOT_DPI = 100;
  const FINAL = ["succeeded", "failed", "cancelled"];
  const $ = (id) => document.getElementById(id);

  // ------------------------------------------------------------------------------ requests
  class HttpError extends Error {
    constructor(status, detail) {
      super(`${status}: ${detail}`);
      this.status = status;
      this.detail = detail;
    }
  }

  const token = () => sessionStorage.getItem(TOKEN_KEY) || "";

  function withAuth(headers) {
    const out = Object.assign({}, headers || {});
    if (AUTH && token()) out.Authorization = `Bearer ${token()}`;
    return out;
  }

  function describe(detail) {
    if (Array.isArray(detail)) {
      return detail.map((d) => `${(d.loc || []).join(".")}: ${d.msg}`).join("; ");
    }
    return String(detail);
  }

  async function api(path, options) {
    const init = Object.assign({}, options || {});
    init.headers = withAuth(init.headers);
    const response = await fetch(path, init);
    if (response.ok) return response;
    let detail = response.statusText;
    try {
      detail = describe((await response.json()).detail);
    } catch (_) {
      // not JSON: keep the status text
    }
    if (response.status === 401 && AUTH) {
      sessionStorage.removeItem(TOKEN_KEY);
      askForToken("The token was not accepted; enter it again.");
    }
    throw new HttpError(response.status, detail);
  }

  const json = async (path, options) => (await api(path, options)).json();

  function say(text) {
    const box = $("message");
    box.textContent = text || "";
    box.hidden = !text;
  }

  function fail(error) {
    say(error instanceof HttpError ? `The server answered ${error.status}: ${error.detail}` : String(error));
  }

  // --------------------------------------------------------------------------------- token
  function askForToken(why) {
    for (const id of ["new-job", "job", "recent"]) $(id).hidden = true;
    $("token-section").hidden = false;
    $("forget-token").hidden = true;
    $("token-status").textContent = why || "";
    $("token").value = "";
    $("token").focus();
  }

  async function useToken(event) {
    event.preventDefault();
    const given = $("token").value.trim();
    if (!given) return;
    sessionStorage.setItem(TOKEN_KEY, given);
    $("token-status").textContent = "Checking the token…";
    try {
      await api("/jobs?limit=1");
    } catch (error) {
      if (!(error instanceof HttpError && error.status === 401)) fail(error);
      return;
    }
    $("token").value = "";
    $("token-status").textContent = "";
    $("token-section").hidden = true;
    start();
  }

  // ------------------------------------------------------------------------------- helpers
  function element(tag, attributes, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attributes || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (key === "text") node.textContent = value;
      else node.setAttribute(key, value === true ? "" : value);
    }
    for (const child of children) {
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function number(value, digits) {
    if (value === null || value === undefined) return "–";
    if (typeof value !== "number") return String(value);
    return Number(value.toPrecision(digits || 4)).toString();
  }

  function list(text, parse) {
    return text.split(",").map((v) => v.trim()).filter((v) => v !== "").map(parse || ((v) => v));
  }

  function numbers(text, what) {
    const values = list(text, Number);
    if (values.some((v) => !Number.isFinite(v))) throw new Error(`${what}: numbers separated by commas`);
    return values;
  }

  async function readJsonFile(file) {
    let text;
    if (file.name.endsWith(".gz")) {
      const stream = file.stream().pipeThrough(new DecompressionStream("gzip"));
      text = await new Response(stream).text();
    } else {
      text = await file.text();
    }
    try {
      return { text, value: JSON.parse(text) };
    } catch (error) {
      throw new Error(`${file.name} is not JSON: ${error.message}`);
    }
  }

  function recentWorkspaces() {
    try {
      return JSON.parse(localStorage.getItem(RECENT_KEY) || "[]");
    } catch (_) {
      return [];
    }
  }

  function rememberWorkspace(id, name) {
    const kept = recentWorkspaces().filter((w) => w.id !== id);
    kept.unshift({ id, name });
    localStorage.setItem(RECENT_KEY, JSON.stringify(kept.slice(0, 10)));
    showRecentWorkspaces();
  }

  function showRecentWorkspaces() {
    const options = recentWorkspaces().map((w) => element("option", { value: w.id, label: w.name }));
    $("recent-workspaces").replaceChildren(...options);
  }

  // -------------------------------------------------------------------------------- tables
  // The operations, their plot kinds and the plot options as the server declares them
  // (GET /tables, pyhf_gpu_client.tables): read once, not copied here.
  let tablesRead = null;
  function serverTables() {
    tablesRead = tablesRead || json("/tables").catch((error) => {
      tablesRead = null; // asked again next time
      throw error;
    });
    return tablesRead;
  }

  // a plot of the chosen patch of a patchset's answer, not of all its patches
  const drawsOnePatch = (kind) => ((shown.tables.plots[kind] || {}).draws === "patch");

  // ------------------------------------------------------------------------------- new job
  function showOperationOptions() {
    const operation = $("operation").value;
    for (const box of document.querySelectorAll(".options")) {
      box.hidden = box.dataset.operation !== operation;
    }
  }

  function operationOptions(operation) {
    const options = {};
    if (operation === "cls") {
      const values = numbers($("test-poi").value, "Tested POI values");
      if (!values.length) throw new Error("Give a tested POI value");
      options.test_poi = values.length === 1 && !$("test-poi").value.includes(",") ? values[0] : values;
      options.test_stat = $("test-stat").value;
    } else if (operation === "upper-limit") {
      options.level = Number($("level").value);
      const scan = numbers($("limit-scan").value, "POI values to scan");
      if (scan.length) options.scan = scan;
    } else if (operation === "fit") {
      options.goodness_of_fit = $("goodness-of-fit").checked;
    } else if (operation === "ranking") {
      if ($("ranking-top").value) options.top = Number($("ranking-top").value);
    } else if (operation === "scan") {
      // no range: the server's default grid, each patch's best fit +- 3 uncertainties
      const axis = { steps: Number($("scan-steps").value) };
      const low = $("scan-low").value.trim();
      const high = $("scan-high").value.trim();
      if (low || high) {
        if (!low || !high) throw new Error("Give both ends of the scan, or neither (best fit ± 3σ)");
        axis.range = [Number(low), Number(high)];
      }
      if ($("scan-parameter").value.trim()) axis.parameter = $("scan-parameter").value.trim();
      options.x = axis;
    }
    return options;
  }

  async function submitJob(event) {
    event.preventDefault();
    say("");
    const status = $("submit-status");
    const button = $("start-job");
    button.disabled = true;
    try {
      const operation = $("operation").value;
      const body = { operation, ...operationOptions(operation) };
      const file = $("workspace-file").files[0];
      if (file) {
        status.textContent = `Uploading ${file.name}…`;
        const workspace = await readJsonFile(file);
        const info = await json("/workspaces", {
          method: "POST",
          headers: { "Content-Type": "application/json" },
          body: workspace.text,
        });
        body.workspace_id = info.workspace_id;
        $("workspace-id").value = info.workspace_id;
        $("workspace-file").value = "";
        rememberWorkspace(info.workspace_id, file.name);
      } else if ($("workspace-id").value.trim()) {
        body.workspace_id = $("workspace-id").value.trim();
      } else {
        throw new Error("Choose a workspace file, or give the id of an uploaded workspace");
      }
      const patchset = $("patchset-file").files[0];
      if (patchset) {
        status.textContent = `Reading ${patchset.name}…`;
        body.patchset = (await readJsonFile(patchset)).value;
        const names = list($("patch-names").value);
        if (names.length) body.patch_names = names;
      }
      status.textContent = "Submitting the job…";
      const accepted = await json("/jobs", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
      });
      status.textContent = `Job ${accepted.id} submitted.`;
      showJob(accepted.id);
    } catch (error) {
      status.textContent = "";
      fail(error);
    } finally {
      button.disabled = false;
    }
  }

  // ------------------------------------------------------------------------------ one job
  let shown = null; // the job on the page: {id, view, plots, patch, tables}

  function showProgress(view) {
    const { done, total } = view.progress;
    const bar = $("progress");
    bar.max = Math.max(total, 1);
    bar.value = view.status === "succeeded" ? bar.max : done;
    const counted = total ? `: ${done} of ${total} hypotheses` : "";
    $("progress-text").textContent = `Job ${view.status}${counted}`;
    $("cancel-job").hidden = FINAL.includes(view.status);
    const summary = $("job-summary");
    const rows = [
      ["Job", view.id],
      ["Operation", view.operation],
      ["Status", view.status],
      ["Submitted", new Date(view.created_at * 1000).toLocaleString()],
    ];
    if (view.finished_at && view.started_at) {
      rows.push(["Run time", `${number(view.finished_at - view.started_at, 3)} s`]);
    }
    summary.replaceChildren(...rows.flatMap(([k, v]) => [element("dt", { text: k }), element("dd", { text: v })]));
  }

  async function watch(id) {
    // server-sent events through fetch: EventSource cannot send the Authorization header
    const response = await api(`/jobs/${encodeURIComponent(id)}/events`, {
      headers: { Accept: "text/event-stream" },
    });
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        let name = "message";
        const data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith("event:")) name = line.slice(6).trim();
          else if (line.startsWith("data:")) data.push(line.slice(5).trim());
        }
        if (!data.length) continue; // a keep-alive comment
        const view = JSON.parse(data.join("\n"));
        if (view.progress) showProgress(view);
        if (name === "done") {
          reader.cancel().catch(() => {});
          return;
        }
      }
    }
  }

  async function showJob(id) {
    shown = { id, view: null, plots: [], patch: null, tables: null };
    $("job").hidden = false;
    $("job-heading").textContent = `Job ${id}`;
    $("report-link").href = `/jobs/${encodeURIComponent(id)}/report`;
    for (const part of ["plots-heading", "results-heading", "results-table", "patch-choice", "doubtful"]) {
      $(part).hidden = true;
    }
    $("plots").replaceChildren();
    $("progress-text").textContent = "Waiting for the job…";
    try {
      let view = await json(`/jobs/${encodeURIComponent(id)}`);
      showProgress(view);
      if (!FINAL.includes(view.status)) {
        await watch(id);
        view = await json(`/jobs/${encodeURIComponent(id)}`);
        showProgress(view);
      }
      if (shown.id !== id) return; // another job was started meanwhile
      shown.view = view;
      if (MODE === "index") refreshJobs();
      if (view.status === "failed" && view.error) {
        say(`The job failed (${view.error.status}): ${describe(view.error.detail)}`);
      }
      if (view.status !== "succeeded") return;
      showDoubtful(view);
      [shown.plots, shown.tables] = await Promise.all([
        json(`/jobs/${encodeURIComponent(id)}/plots`).then((answer) => answer.plots),
        serverTables(),
      ]);
      choosePatch(view);
      await Promise.all([showPlots(), Promise.resolve(showTable())]);
    } catch (error) {
      fail(error);
    }
  }

  // What the server flagged in the results' meta.flags (as the Python client's `doubtful`):
  // fits that did not converge, extra starts that reached different minima, limits past the
  // POI's bounds or outside the scan, the POI's best fit on its bound; one line each, the
  // server's own words (a server without meta.flags: its converged and starts_agreed).
  function metaFlags(meta) {
    if (Array.isArray(meta.flags)) return meta.flags.map((flag) => String(flag.detail));
    const found = [];
    if (meta.converged === false) found.push("its fits did not converge");
    if (meta.starts_agreed === false) found.push("its fits from extra starts reached different minima");
    return found;
  }

  function doubtful(view) {
    const found = [];
    const visit = (item, where) => {
      if (Array.isArray(item)) {
        item.forEach((entry) => visit(entry, where));
        return;
      }
      if (!item || typeof item !== "object" || isError(item) || !item.meta) return;
      const place = [...where];
      if (item.meta.test_poi !== undefined && item.meta.test_poi !== null) place.push(`μ = ${number(item.meta.test_poi)}`);
      const label = place.join(", ") || "The result";
      for (const detail of metaFlags(item.meta)) found.push(`${label}: ${detail}`);
    };
    const entries = isNamed(view) ? Object.entries(view.result) : [[null, view.result]];
    for (const [name, entry] of entries) visit(entry, name === null ? [] : [`Patch ${name}`]);
    return found;
  }

  function showDoubtful(view) {
    const found = doubtful(view);
    $("doubtful-list").replaceChildren(...found.map((line) => element("li", { text: line })));
    $("doubtful").hidden = found.length === 0;
  }

  function isNamed(view) {
    const result = view.result;
    if (!result || typeof result !== "object" || Array.isArray(result)) return false;
    const keys = ["CLs_obs", "mle_parameters", "upper_limit_obs", "p0_obs", "labels", "prefit", "delta_nlls"];
    return !keys.some((k) => k in result);
  }

  const isError = (entry) => entry && typeof entry === "object" && !Array.isArray(entry) && "error" in entry && Object.keys(entry).length === 1;

  function choosePatch(view) {
    const perPatch = shown.plots.some((p) => drawsOnePatch(p.kind)) || !(RESULT_TABLES[view.operation] || {}).everyPatch;
    if (!isNamed(view) || !perPatch) return;
    const names = Object.keys(view.result).filter((name) => !isError(view.result[name]));
    if (!names.length) return;
    shown.patch = names[0];
    $("patch").replaceChildren(...names.map((name) => element("option", { value: name, text: name })));
    $("patch-choice").hidden = names.length < 2;
  }

  async function showPlots() {
    const box = $("plots");
    box.replaceChildren();
    $("plots-heading").hidden = shown.plots.length === 0;
    const loads = shown.plots.map(async (plot) => {
      const perPatch = shown.patch !== null && drawsOnePatch(plot.kind);
      const chosen = new URLSearchParams();
      if (perPatch) chosen.set("patch", shown.patch);
      const what = perPatch ? `${plot.kind} plot of ${shown.patch}` : `${plot.kind} plot`;
      const image = element("img", { alt: `${what}: ${plot.description}`, "data-kind": plot.kind });
      const svg = element("button", { type: "button", class: "link", text: "SVG" });
      const png = element("button", { type: "button", class: "link", text: "PNG" });
      const caption = element("figcaption", {}, element("strong", { text: plot.kind }), ` — ${plot.description} `, svg, " ", png);
      const figure = element("figure", { class: "plot" }, image, caption);
      // a patchset with more coordinates than the plane: the slice drawn, chosen here
      let slice = null;
      if ((plot.slices || []).length > 1) {
        slice = element(
          "select",
          { id: `slice-${plot.kind}` },
          ...plot.slices.map((s) => element("option", { value: s.values.join(","), text: `${s.label} (${s.points} points)` })),
        );
        caption.append(" ", element("label", { for: slice.id, text: "Slice " }), slice);
      }
      box.append(figure);
      const query = () => {
        const q = new URLSearchParams(chosen);
        if (slice) q.set("slice", slice.value);
        return q.toString() ? `?${q}` : "";
      };
      svg.addEventListener("click", () => download(plot.svg + query(), `${shown.id}-${plot.kind}.svg`));
      png.addEventListener("click", () => download(plot.png + query(), `${shown.id}-${plot.kind}.png`));
      const draw = async () => {
        figure.querySelector(".message")?.remove();
        try {
          const sep = query() ? "&" : "?";
          const blob = await (await api(`${plot.png}${query()}${sep}dpi=${PLOT_DPI}`)).blob();
          image.src = URL.createObjectURL(blob);
          await image.decode();
          image.dataset.slice = slice ? slice.value : "";
        } catch (error) {
          figure.append(element("p", { class: "message", text: `Could not draw it: ${error.detail || error}` }));
        }
      };
      if (slice) slice.addEventListener("change", draw);
      await draw();
    });
    await Promise.all(loads);
  }

  async function download(path, name) {
    try {
      const blob = await (await api(path)).blob();
      const link = element("a", { href: URL.createObjectURL(blob), download: name });
      document.body.append(link);
      link.click();
      link.remove();
    } catch (error) {
      fail(error);
    }
  }

  // -------------------------------------------------------------------------------- tables
  function table(head, rows) {
    const tableNode = $("results-table");
    tableNode.tHead.replaceChildren(element("tr", {}, ...head.map((h) => element("th", { scope: "col", text: h }))));
    tableNode.tBodies[0].replaceChildren(
      ...rows.map((row) => element("tr", {}, ...row.map((cell, i) => element(i === 0 ? "th" : "td", i === 0 ? { scope: "row", text: cell } : { text: cell })))),
    );
    tableNode.hidden = false;
    $("results-heading").hidden = false;
  }

  // a row's label, marked when the server flagged its result (the alert above says what)
  const mark = (label, r) => (r && r.meta && metaFlags(r.meta).length ? `${label} ⚠` : label);

  const errorRow = (name, entry, width) => [name, `error ${entry.error.status}: ${describe(entry.error.detail)}`, ...Array(width - 2).fill("")];

  function clsRows(name, entry) {
    const one = (r, label) => [
      mark(label, r),
      number(r.CLs_obs),
      number(r.CLs_exp[2]),
      `${number(r.CLs_exp[1])} – ${number(r.CLs_exp[3])}`,
      r.CLs_obs !== null && r.CLs_obs < 0.05 ? "yes" : "no",
    ];
    if (Array.isArray(entry)) return entry.map((r) => one(r, name === null ? number(r.meta.test_poi) : `${name} (μ = ${number(r.meta.test_poi)})`));
    return [one(entry, name === null ? number(entry.meta.test_poi) : name)];
  }

  // The results table of each operation's answer: `everyPatch` ones have a row for each
  // patch of a patchset's answer (shown(entries): [[patch or null, entry], ...]), the others
  // show the chosen patch's (shown(entry)).
  const limitRow = (name, r) => [mark(name || "–", r), number(r.upper_limit_obs), number(r.upper_limit_exp[2]), number(r.upper_limit_exp[1]), number(r.upper_limit_exp[3])];
  const significanceRow = (name, r) => [mark(name || "–", r), number(r.p0_obs), number(r.z_obs), number(r.p0_exp), number(r.z_exp)];
  const RESULT_TABLES = {
    cls: {
      everyPatch: true,
      shown: (entries, named) => table(
        [named ? "Patch" : "POI value", "CLs observed", "CLs expected (median)", "Expected ±1σ", "Excluded at 95% CL"],
        entries.flatMap(([name, entry]) => (isError(entry) ? [errorRow(name, entry, 5)] : clsRows(name, entry))),
      ),
    },
    "upper-limit": {
      everyPatch: true,
      shown: (entries) => table(
        ["Patch", "Observed limit", "Expected limit (median)", "Expected −1σ", "Expected +1σ"],
        entries.map(([name, r]) => (isError(r) ? errorRow(name, r, 5) : limitRow(name, r))),
      ),
    },
    significance: {
      everyPatch: true,
      shown: (entries) => table(
        ["Patch", "p₀ observed", "Z observed", "p₀ expected", "Z expected"],
        entries.map(([name, r]) => (isError(r) ? errorRow(name, r, 5) : significanceRow(name, r))),
      ),
    },
    fit: {
      shown: (r) => {
        const rows = [];
        for (const [parameter, values] of Object.entries(r.mle_parameters)) {
          values.forEach((v, i) => rows.push([values.length > 1 ? `${parameter}[${i}]` : parameter, number(v), number(r.uncertainties[parameter][i])]));
        }
        table(["Parameter", "Best fit", "Uncertainty"], rows);
      },
    },
    ranking: {
      shown: (r) => table(
        ["Parameter", "Pull", "Post-fit impact +", "Post-fit impact −", "Pre-fit impact +", "Pre-fit impact −"],
        r.labels.map((label, i) => [label, number(r.pull[i]), number(r.postfit_up[i]), number(r.postfit_down[i]), number(r.prefit_up[i]), number(r.prefit_down[i])]),
      ),
    },
    scan: {
      shown: (r) => {
        if (r.names) {
          table(["Parameter", "Best fit", "Uncertainty"], r.names.map((n, i) => [n, number(r.bestfit[i]), number(r.uncertainty[i])]));
        } else {
          table([r.name, "−2 Δln L"], r.parameter_values.map((v, i) => [number(v), number(r.delta_nlls[i])]));
        }
      },
    },
    yields: {
      shown: (r) => table(
        ["Channel", "Pre-fit total", "Post-fit total", "Data"],
        Object.keys(r.prefit).map((c) => [c, number(r.prefit[c].total.channel_yield), number(r.postfit[c].total.channel_yield), number(r.prefit[c].channel_data)]),
      ),
    },
  };

  function showTable() {
    const view = shown.view;
    const kind = RESULT_TABLES[view.operation];
    if (!kind) return;
    const named = isNamed(view);
    if (kind.everyPatch) kind.shown(named ? Object.entries(view.result) : [[null, view.result]], named);
    else kind.shown(named ? view.result[shown.patch] : view.result);
  }

  async function patchChanged() {
    shown.patch = $("patch").value;
    showTable();
    await showPlots();
  }

  async function cancelJob() {
    if (!shown) return;
    try {
      await api(`/jobs/${encodeURIComponent(shown.id)}`, { method: "DELETE" });
    } catch (error) {
      fail(error);
    }
  }

  // ---------------------------------------------------------------------------- job list
  async function refreshJobs() {
    try {
      const { jobs } = await json("/jobs?limit=10");
      const rows = jobs.map((job) => element(
        "tr",
        {},
        element("th", { scope: "row" }, element("a", { href: `/jobs/${encodeURIComponent(job.id)}/report`, text: job.id })),
        element("td", { text: job.operation }),
        element("td", { text: job.status }),
        element("td", { text: `${job.progress.done} / ${job.progress.total}` }),
        element("td", { text: new Date(job.created_at * 1000).toLocaleString() }),
      ));
      $("jobs-table").tBodies[0].replaceChildren(...rows);
      $("recent").hidden = jobs.length === 0;
    } catch (error) {
      fail(error);
    }
  }

  // -------------------------------------------------------------------------------- start
  function start() {
    $("forget-token").hidden = !AUTH;
    if (MODE === "report") {
      const match = window.location.pathname.match(/^\/jobs\/([^/]+)\/report$/);
      if (match) showJob(decodeURIComponent(match[1]));
      return;
    }
    $("new-job").hidden = false;
    showRecentWorkspaces();
    showOperationOptions();
    refreshJobs();
  }

  $("token-form").addEventListener("submit", useToken);
  $("job-form").addEventListener("submit", submitJob);
  $("operation").addEventListener("change", showOperationOptions);
  $("patch").addEventListener("change", patchChanged);
  $("cancel-job").addEventListener("click", cancelJob);
  $("download-json").addEventListener("click", () => shown && download(`/jobs/${encodeURIComponent(shown.id)}`, `${shown.id}.json`));
  $("forget-token").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    askForToken("The token is forgotten.");
  });

  if (AUTH && !token()) askForToken();
  else start();
})();
