/**
 * The Probing panel's views: a toolbar over one React view that re-renders from the
 * model's `changed` signal. Views hold no cluster state of their own (only the text
 * typed into the add-job form).
 */
import { CommandRegistry } from '@lumino/commands';
import { Message } from '@lumino/messaging';
import { Panel, Widget } from '@lumino/widgets';
import { CommandToolbarButton, LabIcon, ReactWidget, SidePanel, UseSignal } from '@jupyterlab/ui-components';
import * as React from 'react';

import { ClusterModel, IRankRow, jobKind, rankGroups, stateCounts, stragglerWhy } from './model';
import { DEFAULT_STEPS, ProfileModel } from './profile';
import { IDeparture, IJob, INodes } from './request';

// three nodes of two ranks; currentColor-free so JupyterLab's icon classes colour it per theme
const clusterSvg = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
  <g class="jp-icon3" fill="#616161">
    <rect x="2" y="3" width="20" height="5" rx="1"/><rect x="2" y="10" width="20" height="5" rx="1"/>
    <rect x="2" y="17" width="20" height="5" rx="1"/>
  </g>
  <g class="jp-icon-contrast0" fill="#fff">
    <circle cx="6" cy="5.5" r="1.2"/><circle cx="10" cy="5.5" r="1.2"/><circle cx="6" cy="12.5" r="1.2"/>
    <circle cx="10" cy="12.5" r="1.2"/><circle cx="6" cy="19.5" r="1.2"/><circle cx="10" cy="19.5" r="1.2"/>
  </g>
</svg>`;

export const clusterIcon = new LabIcon({ name: 'probing-magics:cluster', svgstr: clusterSvg });

export const PANEL_TITLE = 'Probing';
export const PANEL_CAPTION = 'Probing: ranks of a running job';

/** The last two parts of a path: "testing/tiny_ddp.py". */
function shortPath(file: string): string {
  return file.split('/').slice(-2).join('/');
}

/** A departure's wall-clock time (the server words ages of members only). */
function clock(epochSeconds: number): string {
  return new Date(epochSeconds * 1000).toLocaleTimeString();
}

function jobLabel(job: IJob): string {
  const size = job.world_size === null ? '' : ` · ${job.world_size} ranks`;
  const where = job.source === 'added' ? ` · ${job.target}` : job.host ? ` · ${job.host}` : '';
  const kind = jobKind(job);
  const ended = kind === 'dumps' ? ' · ended (dumps)' : kind === 'ended' ? ' · ended' : '';
  return `${job.run_id ?? job.id}${size}${where}${ended}`;
}

function JobChooser({ model }: { model: ClusterModel }): JSX.Element | null {
  const job = model.job;
  if (model.jobs.length === 0) {
    return null;
  }
  return (
    <div className="pm-Cluster-jobs">
      <label>
        Job{' '}
        <select
          className="pm-Cluster-jobSelect"
          value={job?.id ?? ''}
          onChange={e => model.choose(e.currentTarget.value)}
        >
          {model.jobs.map(j => (
            <option key={j.id} value={j.id}>
              {jobLabel(j)}
            </option>
          ))}
        </select>
      </label>
      {(job?.source === 'added' || job?.source === 'dump') && (
        <button className="pm-Cluster-linkButton" onClick={() => void model.removeJob(job.id)}>
          forget
        </button>
      )}
    </div>
  );
}

function AddJobForm({ model }: { model: ClusterModel }): JSX.Element {
  const [target, setTarget] = React.useState('');
  const [token, setToken] = React.useState('');
  const [message, setMessage] = React.useState('');
  const [busy, setBusy] = React.useState(false);
  const submit = async (event: React.FormEvent) => {
    event.preventDefault();
    setBusy(true);
    setMessage('');
    try {
      const job = await model.addJob(target.trim(), token);
      setMessage(`added ${job.run_id ?? job.id}`);
      setToken('');
    } catch (error) {
      setMessage(error instanceof Error ? error.message : String(error));
    } finally {
      setBusy(false);
    }
  };
  return (
    <details className="pm-Cluster-add">
      <summary>Add a job by address or by its dumps</summary>
      <form onSubmit={e => void submit(e)}>
        <input
          className="pm-Cluster-addTarget"
          placeholder="tcp://host:port, store://host:port/run_id or dump://DIR"
          value={target}
          onChange={e => setTarget(e.currentTarget.value)}
        />
        <input
          className="pm-Cluster-addToken"
          type="password"
          placeholder="token (kept in the server's memory only)"
          autoComplete="off"
          value={token}
          onChange={e => setToken(e.currentTarget.value)}
        />
        <button type="submit" disabled={busy || !target.trim()}>
          Add
        </button>
        {message && <div className="pm-Cluster-addMessage">{message}</div>}
      </form>
    </details>
  );
}

/** A state as a word beside its colour and shape, so it reads without colour too. */
function StateMark({ state }: { state: string }): JSX.Element {
  return (
    <span className={`pm-Cluster-state pm-state-${state}`} data-state={state}>
      <span className="pm-Cluster-dot" aria-hidden="true" />
      <span className="pm-Cluster-stateWord">{state}</span>
    </span>
  );
}

function Summary({ nodes, updated }: { nodes: INodes; updated: Date | null }): JSX.Element {
  return (
    <div className="pm-Cluster-summary">
      {stateCounts(nodes).map(([state, count]) => (
        <span key={state} className={`pm-Cluster-count pm-state-${state}`} data-state={state}>
          <span className="pm-Cluster-dot" aria-hidden="true" /> {count} {state}
        </span>
      ))}
      {nodes.departures.length > 0 && <span className="pm-Cluster-count">{nodes.departures.length} departed</span>}
      <span className="pm-Cluster-updated">updated {updated ? updated.toLocaleTimeString() : '—'}</span>
    </div>
  );
}

function RankRow(props: {
  row: IRankRow;
  selected: boolean;
  onSelect: () => void;
  slow?: { word: string; detail: string } | null;
}): JSX.Element {
  const { row, selected, slow } = props;
  const classes = ['pm-Cluster-rank', `pm-state-${row.state}`];
  if (row.suspect) {
    classes.push('pm-suspect');
  }
  if (selected) {
    classes.push('pm-selected');
  }
  return (
    <tr
      className={classes.join(' ')}
      data-rank={row.rank}
      data-state={row.state}
      onClick={props.onSelect}
      title={row.detail}
    >
      <td className="pm-Cluster-rankName">
        {row.rank}
        {row.suspect && (
          <span className="pm-Cluster-suspectTag" title="suspect: stuck where the other stalled ranks are not">
            !
          </span>
        )}
        {slow && (
          <span className="pm-Cluster-stragglerTag" data-why={slow.word} title={slow.detail}>
            <span className="pm-Cluster-stragglerShape" aria-hidden="true">
              ▲
            </span>{' '}
            {slow.word}
          </span>
        )}
      </td>
      <td className="pm-Cluster-stateCell">
        <StateMark state={row.state} />
      </td>
      <td className="pm-Cluster-role">{row.role}</td>
      <td className="pm-Cluster-step">{row.step}</td>
      <td className="pm-Cluster-age">{row.seen}</td>
      <td className="pm-Cluster-time" title={row.ratio}>
        <div className="pm-Cluster-barTrack">
          <div className={`pm-Cluster-bar${row.slow ? ' pm-slow' : ''}`} style={{ width: `${row.barPercent}%` }} />
        </div>
        <span className={`pm-Cluster-ms${row.slow ? ' pm-slow' : ''}`}>{row.ms}</span>
      </td>
    </tr>
  );
}

/** An ended job read from its dumps: said with its own word and shape, and when it was last seen. */
function EndedJob({ nodes }: { nodes: INodes }): JSX.Element {
  return (
    <div className="pm-Cluster-ended">
      <span className="pm-Cluster-jobState pm-job-ended" data-job-state="ended">
        <span className="pm-Cluster-endedShape" aria-hidden="true" />
        <span className="pm-Cluster-stateWord">ended</span>
      </span>{' '}
      post-mortem dumps · ranks as last seen at {clock(nodes.now)}
    </div>
  );
}

function ProfileResult({ profile }: { profile: ProfileModel }): JSX.Element | null {
  const view = profile.view;
  const url = profile.traceUrl;
  if (view.phase !== 'done') {
    return null;
  }
  return (
    <div className="pm-Cluster-profileResult">
      <div className="pm-Cluster-profileHeadline">{view.headline}</div>
      {view.failed.map(line => (
        <div key={line} className="pm-Cluster-profileFailed">
          {line}
        </div>
      ))}
      {view.rows.length > 0 && (
        <table className="pm-Cluster-table pm-Cluster-ops">
          <caption>top ops of the slowest rank next to the median rank's (self CPU)</caption>
          <thead>
            <tr>
              {view.columns.map(c => (
                <th key={c}>{c}</th>
              ))}
            </tr>
          </thead>
          <tbody>
            {view.rows.map((row, i) => (
              <tr key={i} className="pm-Cluster-op">
                {row.map((cell, j) => (
                  <td key={j} className={j === 0 ? 'pm-Cluster-opName' : 'pm-Cluster-opMs'} title={cell}>
                    {cell}
                  </td>
                ))}
              </tr>
            ))}
          </tbody>
        </table>
      )}
      {view.trace && url && (
        <div className="pm-Cluster-trace">
          <a className="pm-Cluster-traceLink" href={url} download={view.trace.name}>
            download the merged trace
          </a>{' '}
          ({view.trace.size}; open it in Perfetto or chrome://tracing)
          {view.trace.note && <div className="pm-Cluster-traceNote">{view.trace.note}</div>}
        </div>
      )}
    </div>
  );
}

/** The Profile button of the shown job: steps and ranks asked, then progress, then the answer. */
function Profile({ profile }: { profile: ProfileModel }): JSX.Element {
  const [steps, setSteps] = React.useState(String(DEFAULT_STEPS));
  const [ranks, setRanks] = React.useState('');
  const view = profile.view;
  const stepCount = Number(steps);
  const valid = Number.isInteger(stepCount) && stepCount >= 1;
  const start = (event: React.FormEvent) => {
    event.preventDefault();
    void profile.start({ steps: stepCount, ranks: ranks.trim() || null });
  };
  return (
    <div className="pm-Cluster-profile" data-phase={view.phase}>
      <form className="pm-Cluster-profileForm" onSubmit={start}>
        <button type="submit" className="pm-Cluster-profileButton" disabled={!valid || profile.starting}>
          Profile
        </button>
        <label>
          steps{' '}
          <input
            className="pm-Cluster-profileSteps"
            type="number"
            min={1}
            value={steps}
            onChange={e => setSteps(e.currentTarget.value)}
          />
        </label>
        <label>
          ranks{' '}
          <input
            className="pm-Cluster-profileRanks"
            placeholder="all"
            value={ranks}
            onChange={e => setRanks(e.currentTarget.value)}
          />
        </label>
      </form>
      {profile.error && (
        <div className="pm-Cluster-profileError">
          {profile.error}{' '}
          {profile.canCancel && view.phase !== 'running' && (
            <button className="pm-Cluster-linkButton" onClick={() => void profile.cancel()}>
              cancel it
            </button>
          )}
        </div>
      )}
      {(view.phase === 'starting' || view.phase === 'running') && (
        <div className="pm-Cluster-profileProgress">
          <progress max={100} value={view.percent} /> <span>profiling {view.progress}</span>{' '}
          {view.phase === 'running' && (
            <button className="pm-Cluster-linkButton" onClick={() => void profile.cancel()}>
              cancel
            </button>
          )}
        </div>
      )}
      {(view.phase === 'failed' || view.phase === 'cancelled') && (
        <div className="pm-Cluster-profileFailed">{view.headline}</div>
      )}
      <ProfileResult profile={profile} />
    </div>
  );
}

function Nodes({ model, nodes }: { model: ClusterModel; nodes: INodes }): JSX.Element {
  return (
    <div className="pm-Cluster-nodes">
      {nodes.suspects.map(s => (
        <div key={s.text} className="pm-Cluster-suspect">
          {s.text}
        </div>
      ))}
      {rankGroups(nodes).map(group => (
        <div key={group.node} className="pm-Cluster-node" data-node={group.node}>
          <div className="pm-Cluster-nodeHeader">
            node {group.node} · {group.host}
          </div>
          <table className="pm-Cluster-table">
            <thead>
              <tr>
                <th>rank</th>
                <th>state</th>
                <th>role</th>
                <th>step</th>
                <th>seen</th>
                <th title="milliseconds per step; the bar: the median fills half">ms/step</th>
              </tr>
            </thead>
            <tbody>
              {group.ranks.map(row => (
                <RankRow
                  key={row.rank}
                  row={row}
                  slow={stragglerWhy(model.verdict, row.rank)}
                  selected={model.selectedRank === row.rank}
                  onSelect={() => void model.selectRank(model.selectedRank === row.rank ? null : row.rank)}
                />
              ))}
            </tbody>
          </table>
        </div>
      ))}
      {nodes.departures.length > 0 && <Departures departures={nodes.departures} />}
    </div>
  );
}

function Departures({ departures }: { departures: IDeparture[] }): JSX.Element {
  return (
    <div className="pm-Cluster-departures">
      <div className="pm-Cluster-nodeHeader">departed</div>
      {departures.map(d => (
        <div key={`${d.rank}-${d.incarnation}`} className="pm-Cluster-departure" data-rank={d.rank}>
          rank {d.rank} · {d.why} · at {clock(d.when)} · {d.host} pid {d.pid}
        </div>
      ))}
    </div>
  );
}

function Stack({ model }: { model: ClusterModel }): JSX.Element | null {
  if (model.selectedRank === null) {
    return null;
  }
  const stack = model.stack;
  return (
    <div className="pm-Cluster-stack" data-rank={model.selectedRank}>
      <div className="pm-Cluster-stackHeader">
        <span>
          rank {model.selectedRank}
          {stack ? ` · thread ${stack.thread} · innermost first` : ''}
        </span>
        <button className="pm-Cluster-linkButton" onClick={() => void model.selectRank(null)}>
          close
        </button>
      </div>
      {model.stackMessage && <div className="pm-Cluster-stackMessage">{model.stackMessage}</div>}
      {stack && (
        <ol className="pm-Cluster-frames">
          {stack.frames.map((f, i) => (
            <li key={i} className="pm-Cluster-frame" title={`${f.file}:${f.line ?? '?'}`}>
              <span className="pm-Cluster-function">{f.function}</span>{' '}
              <span className="pm-Cluster-file">
                {shortPath(f.file)}:{f.line ?? '?'}
              </span>
            </li>
          ))}
        </ol>
      )}
    </div>
  );
}

function ClusterBody({ model }: { model: ClusterModel }): JSX.Element {
  const nodes = model.nodes;
  const serverOk = !['starting', 'no-extension', 'server-gone'].includes(model.status);
  const dumps = model.job !== null && jobKind(model.job) === 'dumps';
  return (
    <div className="pm-Cluster-body" data-status={model.status}>
      {serverOk && <JobChooser model={model} />}
      {model.status !== 'ready' && <div className={`pm-Cluster-status pm-status-${model.status}`}>{model.message}</div>}
      {serverOk && model.notice && (
        <div className="pm-Cluster-notice">
          <span>{model.notice}</span>{' '}
          <button className="pm-Cluster-linkButton" onClick={() => model.dismissNotice()}>
            dismiss
          </button>
        </div>
      )}
      {nodes && model.status === 'ready' && (
        <>
          {dumps && <EndedJob nodes={nodes} />}
          <Summary nodes={nodes} updated={model.updated} />
          {model.verdict && (dumps || !model.verdict.healthy) && (
            <div
              className={`pm-Cluster-verdict${model.verdict.healthy ? ' pm-healthy' : ''}`}
              title={model.verdict.checked.join('; ')}
            >
              {model.verdict.summary}
            </div>
          )}
          {model.profile.jobId !== null && <Profile profile={model.profile} />}
          <Nodes model={model} nodes={nodes} />
          <Stack model={model} />
        </>
      )}
      {serverOk && <AddJobForm model={model} />}
    </div>
  );
}

class ClusterView extends ReactWidget {
  constructor(private readonly _model: ClusterModel) {
    super();
    this.addClass('pm-Cluster-view');
  }

  render(): JSX.Element {
    return <UseSignal signal={this._model.changed}>{() => <ClusterBody model={this._model} />}</UseSignal>;
  }
}

/** The sidebar widget: a header, a toolbar (insert-cell command, refresh) and the view. */
export class ClusterPanel extends SidePanel {
  constructor(
    readonly model: ClusterModel,
    commands: CommandRegistry,
    commandIds: string[]
  ) {
    super({ content: new Panel() }); // a plain panel: the default accordion would add a title row
    this.id = 'probing-cluster';
    this.addClass('pm-Cluster');
    this.title.icon = clusterIcon;
    // named apart from ipyparallel's "Clusters" tab, which shared hubs often show beside it
    this.title.caption = PANEL_CAPTION;
    const heading = document.createElement('h2');
    heading.textContent = PANEL_TITLE;
    this.header.addWidget(new Widget({ node: heading }));
    for (const id of commandIds) {
      this.toolbar.addItem(id, new CommandToolbarButton({ commands, id, label: '' }));
    }
    this.addWidget(new ClusterView(model));
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    this.model.visible = true;
  }

  protected onAfterHide(msg: Message): void {
    super.onAfterHide(msg);
    this.model.visible = false;
  }

  dispose(): void {
    this.model.dispose();
    super.dispose();
  }
}
